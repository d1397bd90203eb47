"""What the caller said: streaming transcripts from Kyutai's delayed-streams speech-to-text models.

A transcriber is a second, small model stepped in the scheduler thread right after the dialogue
model, over the same rows and the same caller frames (``core.scheduler``): one batched step per
tick, whatever the backend (echo, synthetic, moshi), and no thread crossing of its own (its pieces
ride in the step's ``StepOutcome``).

* ``model``: what a loaded STT model is (Mimi, the LM, the tokenizer, its delay and prefix), from a
  checkpoint in Kyutai's layout or the seeded ``stt-tiny`` random model (``tiny``);
* ``pieces``: the text a row produced in a step, with where in the caller's audio it belongs;
* ``rows``: restoring one row of the streaming state to a fresh row's (a reused slot);
* ``transcriber``: the batched streaming transcriber itself.

Importing this package imports neither torch nor ``moshi`` (a server without torch imports it
through the scheduler); ``transcriber.Transcriber.load`` does, on the scheduler thread.
"""

from duplexrt.transcribe.pieces import TranscriptPiece

__all__ = ["TranscriptPiece"]

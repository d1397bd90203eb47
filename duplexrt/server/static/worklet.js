// The audio thread of the talk page: one AudioWorklet node both ways.
//  - in:  the microphone at the context's rate, resampled to the model's rate, posted to the
//         page in 20 ms chunks (the page sends them on the WebSocket);
//  - out: the model's audio (model rate) from a small jitter buffer, resampled to the context's
//         rate.  Playback starts once `targetMs` is buffered and starts over (counting a late
//         frame) whenever the buffer runs dry; a buffer grown past `maxMs` drops its oldest audio,
//         so lag cannot build up without bound.
class DuplexProcessor extends AudioWorkletProcessor {
  constructor(options) {
    super();
    const o = options.processorOptions || {};
    this.modelRate = o.modelRate || 24000;
    this.targetMs = o.targetMs || 60;
    this.maxMs = o.maxMs || 400;
    this.inStep = sampleRate / this.modelRate;   // context samples per model sample
    this.inPos = 0;                              // fractional read position in `inPrev + block`
    this.inPrev = 0;                             // last context sample of the previous block
    this.chunk = new Float32Array(Math.round(this.modelRate * 0.02));
    this.chunkFill = 0;
    this.ring = new Float32Array(this.modelRate * 4);
    this.head = 0;                               // next sample to play
    this.level = 0;                              // samples buffered
    this.outPos = 0;                             // fractional position between ring samples
    this.playing = false;
    this.late = 0;
    this.dropped = 0;
    this.played = 0;
    this.peak = 0;
    this.sending = false;
    this.blocks = 0;
    this.port.onmessage = (e) => {
      const m = e.data;
      if (m.type === 'play') this.push(m.samples);
      else if (m.type === 'send') this.sending = m.on;
    };
  }

  push(samples) {
    const cap = this.ring.length;
    for (let i = 0; i < samples.length; i++) {
      if (this.level === cap) { this.head = (this.head + 1) % cap; this.level--; this.dropped++; }
      this.ring[(this.head + this.level) % cap] = samples[i];
      this.level++;
    }
    const max = Math.round(this.modelRate * this.maxMs / 1000);
    if (this.level > max) {
      const drop = this.level - Math.round(this.modelRate * this.targetMs / 1000);
      this.head = (this.head + drop) % cap; this.level -= drop; this.dropped += drop;
    }
  }

  capture(block) {
    // Linear interpolation from the context rate down (or up) to the model rate.
    const n = block.length;
    let pos = this.inPos;
    while (pos < n) {
      const i = Math.floor(pos), f = pos - i;
      const a = i === 0 ? this.inPrev : block[i - 1], b = block[i];
      this.chunk[this.chunkFill++] = a + (b - a) * f;
      if (this.chunkFill === this.chunk.length) {
        const out = this.chunk;
        this.chunk = new Float32Array(out.length);   // before the transfer empties `out`
        this.port.postMessage({ type: 'mic', samples: out }, [out.buffer]);
        this.chunkFill = 0;
      }
      pos += this.inStep;
    }
    this.inPos = pos - n;
    this.inPrev = block[n - 1];
  }

  render(out) {
    const step = this.modelRate / sampleRate;   // model samples per context sample
    const cap = this.ring.length;
    if (!this.playing && this.level >= Math.round(this.modelRate * this.targetMs / 1000)) this.playing = true;
    for (let i = 0; i < out.length; i++) {
      if (!this.playing || this.level < 2) {
        if (this.playing) { this.playing = false; this.late++; }
        out[i] = 0;
        continue;
      }
      const a = this.ring[this.head], b = this.ring[(this.head + 1) % cap];
      const v = a + (b - a) * this.outPos;
      out[i] = v;
      const mag = v < 0 ? -v : v;
      if (mag > this.peak) this.peak = mag;
      this.outPos += step;
      while (this.outPos >= 1 && this.level > 1) {
        this.outPos -= 1; this.head = (this.head + 1) % cap; this.level--; this.played++;
      }
    }
  }

  process(inputs, outputs) {
    const input = inputs[0];
    if (this.sending && input && input.length) this.capture(input[0]);
    const output = outputs[0];
    if (output && output.length) {
      this.render(output[0]);
      for (let c = 1; c < output.length; c++) output[c].set(output[0]);
    }
    if (++this.blocks % 12 === 0) {   // ~30 times a second at 48 kHz
      this.port.postMessage({ type: 'stats', blocks: this.blocks, bufferMs: this.level * 1000 / this.modelRate, late: this.late,
                              dropped: this.dropped, played: this.played, peak: this.peak,
                              playing: this.playing });
    }
    return true;
  }
}

registerProcessor('duplexrt-audio', DuplexProcessor);

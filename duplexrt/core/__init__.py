"""The runtime core: what a frame passes through between a session and the model.

A session (``duplexrt.session``) -> ``inbox`` (the one structure shared with the scheduler
thread) -> ``scheduler`` (the thread that owns the model, one step per batch) -> back through
``handoffs`` (every thread crossing, counted) to the slot's owner (``slot_owner``: the session,
as the scheduler sees it), with ``metrics``/``histogram`` (per-frame figures), ``capacity``
(step cost by batch size) and ``affinity`` (pinning the two GIL-bound threads).
``duplexrt.runtime`` ties them and the sessions together for one model, above both.  The wire
(``duplexrt.wire``) and the translators (``duplexrt.protocols``) sit outside it: the server and
the clients use them too.
"""

"""Per-call transcripts: both sides of a call, with their times, kept after it ends
(``store.py``, served at ``GET /v1/transcripts/{id}``) and/or appended to a JSON Lines file per
day (``sink.py``).  A session assembles its own record on the trio thread (``record.py``) and
hands it over once, when it ends (``keeper.py``): nothing here runs per frame off that thread."""

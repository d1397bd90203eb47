"""Wire protocols as pure translators between messages and typed events (no I/O here)."""

"""One conversation between a client and a slot of the model, as explicit objects.

``session`` builds and runs one (``Session``); ``reader`` takes the client's messages into
frames in the slot; ``writer`` sends the model's output back; ``credits`` is what ties the two
directions together; ``outgoing`` is the one ordered queue of messages to the client;
``lifecycle`` is the state and why the session ends.
"""

"""The wire: how a session's messages reach a client and come back.

``transport`` is what a session talks through (``Transport``, and ``DirectSend`` where a step's
output can go out from its delivery); ``frames`` parses and lays out RFC 6455 frames, sans-IO;
``handshake`` is the opening handshake, both sides; ``native`` drives frames over a trio socket
for the server and the clients' ``ws://``; ``wss`` adapts trio-websocket for the clients'
``wss://``; ``resume`` keeps a server session over a connection that drops and comes back.
"""

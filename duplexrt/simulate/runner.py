"""Drive N virtual sessions through the real session pipeline and measure what the host paid.

In process (``run_simulation``), each virtual client gets an in-memory transport (the interface a
network connection has) to a real ``Session`` on a real ``Runtime``: reader, decoder, framer,
inbox, scheduler thread, writer.  Resource usage is read from the kernel for the whole process,
scheduler thread and load generator included, so nothing the runtime costs can hide.

Against a running server (``run_url_simulation``, ``duplexrt simulate --url``), each virtual
client is a real WebSocket speaking the route's protocol.  The runtime's counters are then in
another process: its ``/metrics`` is scraped before and after each round and the server-side
figures are the differences; this process's own CPU is reported apart, as the load generator's.

Either way, each virtual client is the same code (``_VirtualClient`` driving a
``duplexrt.client.Conversation``): it sends its workload's messages in a burst or paced,
receives, keeps a CRC per output frame for the guards and, paced, measures each frame's lag.
Only the transport and the protocol differ: an in-memory pair and the raw protocol in process; a
WebSocket and the route's client protocol (``duplexrt.client.protocols``) over the network.
"""

from __future__ import annotations

# The entry points, one module per job: options.py (what a run is asked), virtual_client.py (one
# virtual client, both paths), in_process.py (a round on an in-process runtime) and network.py
# (a round against a running server).
from duplexrt.simulate.in_process import run_find_capacity, run_simulation
from duplexrt.simulate.network import UrlTarget, default_format, run_url_find_capacity, run_url_simulation
from duplexrt.simulate.options import MODES, ROUTE_FORMATS, SimulateOptions

__all__ = ["MODES", "ROUTE_FORMATS", "SimulateOptions", "UrlTarget", "default_format", "run_find_capacity",
           "run_simulation", "run_url_find_capacity", "run_url_simulation"]

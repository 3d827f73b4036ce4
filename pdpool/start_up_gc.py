"""Objects made while a server starts, taken out of the garbage collector's reach.

A full collection walks every tracked object and holds up every stream of the process
meanwhile. Start-up leaves the most: modules, the app, and in an engine torch's and
transformers' modules and the KV cache's bookkeeping (about 240k objects; a full
collection of them took 105-109 ms on an idle 2-core machine, the sidecar's 46k 45-77 ms
on a busy one). Under load such a collection comes every few seconds, as request objects
that outlive two young collections pile up. Those objects live as long as the process
anyway, so they are frozen: later collections walk only what came after.
"""

from __future__ import annotations

import gc


def freeze_start_up_objects() -> None:
    """Collects once (start-up's garbage is not kept), then freezes what is left."""
    gc.collect()
    gc.freeze()

"""bccl's transport between real ranks: each call agreed on by the ranks, then carried by gloo over host views.

transport.py is the transport (the distributed package registers it as bccl's); the rest is its
own: signatures.py and signature_exchange.py (what the ranks agree on before a collective, and
the shared-memory board or gloo exchange that carries it), composed.py (collectives built from
gloo's all-to-all), self_p2p.py (send and receive to the rank itself), work.py (its works: the
peers' check at wait, gloo's error types) and handoff.py (gloo's works kept until gloo lets go).
Nothing here imports the c10d face (process_group.py).
"""

from .signature_exchange import CollectiveMismatchError
from .transport import GlooTransport
from .work import GlooWork

__all__ = ["CollectiveMismatchError", "GlooTransport", "GlooWork"]

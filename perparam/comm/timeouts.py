"""``CollectiveTimeoutError``: a collective (or the store's agreement before one) that a peer rank did not
join in time, or left; on its own so that ``sequence.py`` (which raises it) and ``peers.py``
(``PeerLostError`` derives from it) import it without importing each other."""


class CollectiveTimeoutError(RuntimeError):
    """A sharded module's forward waited in a collective that a peer rank did not issue (or a peer exited),
    or a call that is a collective (``optimizer.state_dict()`` with owner parameters) was made on some ranks
    only (``enter_together``)."""

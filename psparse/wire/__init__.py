"""What crosses the network: ZeroMQ transport, index codecs, the messages, the run description.

* ``transport.py``: sockets, bounded waits, byte accounting, link pacing, CurveZMQ;
* ``codec.py``: index encodings (raw, delta, bitmap) and key caches; ``protocol.py``: the
  messages and their validation; ``run_description.py``: the run a worker registers with, its
  comparison and the run token's proofs (all of it is docs/protocol.md);
* ``keyranges.py``: the key ranges of server shards; ``keys.py``: ``psparse-keys``.
"""

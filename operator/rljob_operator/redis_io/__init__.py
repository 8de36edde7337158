"""The operator's Redis I/O, all of it: :mod:`.clients` (connecting, the clients shared by the jobs on one Redis,
TLS failures) and :mod:`.reads` (what a pass reads: Redis health and the progress hashes). The keys, fields and their
parsing are :mod:`rljob_api.protocol`'s."""

"""rljob_wire: the contract between rljob's pods, and with Fast-LLM and PipelineRL.

What one pod writes and another reads, in one place that both roles import and neither owns:

- :mod:`.codec`: one stream entry = one document (DESIGN §3), byte-compatible with Fast-LLM's and PipelineRL's
  Redis documents (their variants decode too; tests/wire/test_codec.py holds the compatibility cases);
- :mod:`.documents`: decoded documents, one (``Document``) or a batch as columns (``DocumentColumns``);
- :mod:`.connection`: the Redis connection every trainer and rollout process opens (password from the environment, TLS, retry with backoff);
- :mod:`.transfer`: the weight-transfer wire (DESIGN §6): a Redis ticket names a torch.distributed rendezvous, the
  trainer broadcasts the tensors, each rollout receives them (``send_update`` / ``receive_update``);
- :mod:`.model`: the model construction both ends share (the tiny digit model, Hugging Face loading, tokenizers), so
  a tensor the trainer sends has the name and shape the rollout expects.

Changing anything here changes what other pods, other versions of rljob and upstream readers see: keep it
backward-compatible or version it (DESIGN §3, §6). ``rljob_trainer`` and ``rljob_rollout`` sit above this package and
never import each other; the Redis key and message names of the protocol are in :mod:`rljob_api.protocol`.
"""

"""rljob_operator: the kopf operator that turns an RLTrainingJob into Redis, a trainer gang and rollout pods.

Modules, one job each: :mod:`.crd` (CRD from the pydantic models), :mod:`.render` (pure: spec → child
manifests), :mod:`.observe` (pure: pods and Deployments → small views), :mod:`.gang` (pure: the gang state
machine of DESIGN §5), :mod:`.status` (pure: observations → conditions and phase), :mod:`.progress` (Redis
progress hashes), :mod:`.apply` (the only Kubernetes API calls), :mod:`.reconcile` (one pass: parse → render
→ apply → report), :mod:`.handlers` (kopf handlers), :mod:`.settings` (kopf startup), :mod:`.metrics`
(Prometheus) and :mod:`.cli` (the ``rljob`` command).
"""

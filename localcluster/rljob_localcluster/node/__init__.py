"""Parts of the local cluster's real nodes (``rljob_localcluster.nodes.LocalNodes`` puts them together):

- ``configs``: containerd, CNI, kubelet, kube-proxy and CoreDNS configuration (pure functions);
- ``host``: what the nodes change on the host and undoing it (sysctls, cgroups, mounts, bridges, chains);
- ``dns``: the kube-dns Service/EndpointSlice for CoreDNS on the host, and a tiny DNS client;
- ``controller``: the PV provisioner of the default StorageClass and the fake GPU capacity (own process).
"""

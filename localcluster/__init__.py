"""The local control plane: etcd, kube-apiserver, kube-controller-manager, kube-scheduler and
KWOK as real processes on this machine, with podrunner as the kubelet that runs opted-in pods
as local processes (`python -m localcluster up`)."""

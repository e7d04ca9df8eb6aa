"""The rewrites SGLang would otherwise make silently at boot, made visible: each one a finding."""

from __future__ import annotations

from hicache_operator.api import flags
from hicache_operator.api.spec import HiCacheDeploymentSpec
from hicache_operator.fleet.storage_config import hostname_paths, without_hostnames
from hicache_operator.plan import render
from hicache_operator.plan.validation.findings import Finding, finding

MOONCAKE_DEFAULTS = {"protocol": "tcp", "metadata_server": "P2PHANDSHAKE"}


def normalise(spec: HiCacheDeploymentSpec, name: str | None = None,
              namespace: str = "default") -> tuple[HiCacheDeploymentSpec, list[Finding]]:
    """The effective spec and one finding per rewrite (in SGLang's order of _handle_hicache).

    A managed master's address (and its HTTP metadata server, when it runs one and
    metadataServer is unset) becomes the effective mooncake settings; that needs the
    deployment's ``name``, without which they stay unset."""
    d = spec.dump()
    hc = d["hicache"]
    st = hc["storage"]
    out: list[Finding] = []
    managed = spec.hicache.storage.mooncake.managed if spec.hicache.storage.mooncake else None
    if managed is not None and name is not None and "master_server_address" not in st["extraConfig"]:
        st["mooncake"]["masterAddress"] = render.mooncake_master_address(managed, name, namespace)
        if managed.http_metadata_server is not None and st["mooncake"].get("metadataServer") is None:
            st["mooncake"]["metadataServer"] = render.mooncake_metadata_url(managed, name, namespace)
    if hc["memLayout"] == "page_first_direct" and hc["ioBackend"] == "kernel":
        hc["ioBackend"] = "direct"
        out.append(finding("page-first-direct-kernel-io"))
    if st["backend"] == "mooncake" and hc["memLayout"] == "layer_first":
        hc["memLayout"] = "page_first" if hc["ioBackend"] == "kernel" else "page_first_direct"
        out.append(finding("mooncake-layer-first", layout=hc["memLayout"], io=hc["ioBackend"]))
    if hc["memLayout"] == "page_first" and hc["ioBackend"] == "direct":
        hc["memLayout"] = "page_first_direct"
        out.append(finding("page-first-direct-io"))

    extra = dict(st["extraConfig"] or {})
    hostnames = hostname_paths(extra)
    if hostnames:
        extra = without_hostnames(extra)
        out.append(finding("extra-config-local-hostname", paths=", ".join(hostnames)))
    if st["backend"] != "none":
        known = flags.KNOWN_EXTRA_CONFIG_KEYS[st["backend"]] | flags.PREFETCH_KNOBS
        for key in sorted(set(extra) - known):
            out.append(finding("extra-config-unknown-key", key=key, backend=st["backend"],
                               known=", ".join(sorted(flags.KNOWN_EXTRA_CONFIG_KEYS[st["backend"]]))))
    if st["backend"] == "mooncake":
        for fld, key, _env in flags.MOONCAKE_SETTINGS:
            ours = (st.get("mooncake") or {}).get(fld)
            if ours is None:
                continue
            if key in extra and extra[key] != ours:
                out.append(finding("mooncake-config-conflict", field=fld, ours=ours, key=key, theirs=extra[key]))
            else:
                extra[key] = ours
        for key, value in MOONCAKE_DEFAULTS.items():
            extra.setdefault(key, value)
    st["extraConfig"] = extra
    return HiCacheDeploymentSpec.model_validate(d), out

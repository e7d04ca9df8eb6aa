"""bench/swap.py's split of each procedure: how long the EndpointSlice controller took to show
each Ready flip, and how often it refused a sync on its own stale cache (read from its log)."""

from __future__ import annotations

import importlib.util
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[3]
_spec = importlib.util.spec_from_file_location("swap_bench", REPO / "bench" / "swap.py")
swap = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(swap)


def klog_stale(t: float, key: str) -> str:
    stamp = time.strftime("%m%d %H:%M:%S", time.localtime(t)) + f"{t % 1:.6f}"[1:]
    return (f'I{stamp}   17226 endpointslice_controller.go:344] "Error syncing endpoint slices for service, '
            f'retrying" logger="endpointslice-controller" key="{key}" err="EndpointSlice informer cache is out of date"')


def test_stale_retries_counts_the_services_refusals_inside_the_window(tmp_path):
    t0 = time.mktime((2026, 11, 22, 8, 42, 27, 0, 0, -1)) + 0.25
    log = tmp_path / "kube-controller-manager.log"
    log.write_text("\n".join([
        klog_stale(t0 - 5, "ns/fleet"),  # before the swap
        klog_stale(t0 + 0.1, "ns/fleet"),
        klog_stale(t0 + 0.1, "ns/fleet-pods"),  # the headless Service
        'I1122 08:42:27.400000   17226 endpointslice_controller.go:300] "something else" key="ns/fleet"',
        klog_stale(t0 + 1.9, "ns/fleet"),
        klog_stale(t0 + 3, "ns/fleet"),  # after it
    ]))
    assert swap.stale_retries(log, "ns/fleet", t0, t0 + 2) == 2


def test_endpoint_lags_pair_each_ready_flip_with_the_slice_showing_it():
    tl = swap.Timeline(None, "ns", "fleet")
    tl.events = [(1.0, "a", "gate=False"), (1.1, "a", "ready=False"), (1.3, "a", "endpoint=False"),
                 (2.0, "a", "ready=True"), (2.1, "b", "ready=False"), (2.15, "b", "endpoint=False"),
                 (3.0, "a", "endpoint=True"),
                 (4.0, "b", "ready=True"), (4.1, "b", "ready=False"), (4.2, "b", "endpoint=False")]
    # b flipped back before its slice showed True: only the flip the slice showed counts, from its own time
    assert [round(x, 3) for x in swap.Timeline.endpoint_lags(tl)] == [0.2, 0.05, 1.0, 0.1]


def test_take_outs_reads_each_pods_first_take_out_from_the_operators_step_lines(tmp_path):
    log = tmp_path / "operator.log"
    log.write_text("\n".join([
        "[2026-11-22 11:17:26,007] hicache_operator.swap [INFO    ] swap step other/fleet at=99.000 (spec waited=0.000) "
        "observe=0.004 plan+act=0.026 passes=1 renewing=0 actions=SetServingGate:fleet-0:False@0.001",
        "[2026-11-22 11:17:26,007] hicache_operator.swap [INFO    ] swap step ns/fleet at=100.000 (spec waited=0.000) "
        "observe=0.004 plan+act=0.026 passes=1 renewing=10 actions=SetServingGate:fleet-0:False@0.005,"
        "SetServingGate:fleet-1:False@0.006",
        "[2026-11-22 11:17:27,124] hicache_operator.swap [INFO    ] swap step ns/fleet at=101.000 (endpointslice "
        "waited=0.174) observe=0.163 plan+act=0.452 passes=3 renewing=0 actions=Attach:fleet-0,"
        "SetServingGate:fleet-0:True@0.300,SetServingGate:fleet-2:False@0.412,SetServingGate:fleet-1:False@0.500",
    ]))
    sent = swap.take_outs(swap.operator_steps(log, 0, "ns"))
    assert {pod: round(t, 3) for pod, t in sent.items()} == {"fleet-0": 100.005, "fleet-1": 100.006,
                                                            "fleet-2": 101.412}


def test_summarize_gives_each_size_the_spread_of_its_ratios_and_the_runs_meeting_the_goal():
    def run(pods, mu, ratio, failed=0):
        return {"pods": pods, "max_unavailable": mu, "ratio": ratio, "failed_requests": failed, "requests": 100}
    rows = swap.summarize([run(16, 8, 1.25), run(16, 8, 1.1), run(16, 8, 1.15, failed=1), run(64, 8, 1.05),
                           run(16, 8, float("nan"))])
    by_size = {(r["pods"], r["max_unavailable"]): r for r in rows}
    wave = by_size[16, 8]
    assert (wave["runs"], wave["ratio_median"], wave["ratio_min"], wave["ratio_max"]) == (4, 1.15, 1.1, 1.25)
    assert wave["ratio_mean"] == round((1.25 + 1.1 + 1.15) / 3, 3)
    assert wave["runs_meeting_goal"] == 1  # 1.25 is over, 1.15 failed a request, nan measured nothing
    assert (wave["failed_requests"], wave["requests"]) == (1, 400)
    assert by_size[64, 8]["runs_meeting_goal"] == 1

"""Where a kernel's warps wait, from an Nsight Compute report: the warp-state samples of each kernel in
an ``.ncu-rep`` file (ncu's SourceCounters section, per SASS instruction) summed by stall reason, by
source line and by instruction, the hottest first.

    python scripts/probe/ncu_hot.py REPORT.ncu-rep [--top N]

Needs NVIDIA's ``ncu_report`` module: on the GPU machine it ships with Nsight Compute
(``<ncu dir>/extras/python``); elsewhere the ``ncu-report`` wheel from PyPI reads the same files
(reports fetched back from the device tool: scripts/probe/gpu_profile.sh saves them). Prints, per kernel
launch: its time, the total samples, the reasons' shares, then the top source lines and the top
instructions with their own reason split. A sample is one warp caught in one state, so the shares say
where warp time goes, not which instruction is slow by itself (a warp waiting at a barrier is charged to
the barrier)."""
import argparse
import collections
import glob
import os
import sys

PREFIX = "smsp__pcsamp_warps_issue_stalled_"


def import_ncu_report():
    try:
        import ncu_report
        return ncu_report
    except ImportError:
        pass
    # Nsight Compute's own copy, next to the ncu binary (the GPU machine has no PyPI access).
    for root in ("/usr/local/cuda/nsight-compute*", "/opt/nvidia/nsight-compute/*", "/usr/local/cuda"):
        for d in glob.glob(os.path.join(root, "extras", "python")):
            sys.path.append(d)
            try:
                import ncu_report
                return ncu_report
            except ImportError:
                sys.path.pop()
    raise SystemExit("ncu_hot: no ncu_report module (pip install ncu-report, or run where Nsight Compute is)")


def samples_by_pc(action):
    """{pc: {reason: samples}} of one launch, from the per-instruction pcsamp metrics (the *_not_issued
    twins are left out: they count the same samples again, split by whether the warp then issued)."""
    by_pc = collections.defaultdict(collections.Counter)
    for name in action.metric_names():
        if not name.startswith(PREFIX) or name.endswith("_not_issued"):
            continue
        metric = action.metric_by_name(name)
        if metric.num_instances() == 0 or not metric.has_correlation_ids():
            continue
        pcs = metric.correlation_ids()
        reason = name[len(PREFIX):]
        for i in range(metric.num_instances()):
            value = metric.as_uint64(i)
            if value:
                by_pc[pcs.as_uint64(i)][reason] += value
    return by_pc


def where(action, pc):
    info = action.source_info(pc)
    if info is None:
        return "?"
    return f"{os.path.basename(info.file_name())}:{info.line()}"


def split(counter, total, most=3):
    return ", ".join(f"{reason} {100 * n / total:.0f}%" for reason, n in counter.most_common(most))


def report(path, top):
    ncu_report = import_ncu_report()
    ctx = ncu_report.load_report(path)
    print(f"== {path}")
    for ri in range(ctx.num_ranges()):
        rng = ctx.range_by_idx(ri)
        for ai in range(rng.num_actions()):
            action = rng.action_by_idx(ai)
            by_pc = samples_by_pc(action)
            total = sum(sum(c.values()) for c in by_pc.values())
            duration = action.metric_by_name("gpu__time_duration.sum")
            us = duration.as_double() / 1000 if duration is not None else float("nan")
            print(f"-- {action.name()}: {us:.1f} us, {total} samples")
            if total == 0:
                continue
            reasons = collections.Counter()
            lines = collections.defaultdict(collections.Counter)
            for pc, counter in by_pc.items():
                reasons.update(counter)
                lines[where(action, pc)].update(counter)
            print("   reasons: " + split(reasons, total, most=8))
            print("   source lines:")
            for line, counter in sorted(lines.items(), key=lambda kv: -sum(kv[1].values()))[:top]:
                n = sum(counter.values())
                print(f"   {100 * n / total:5.1f}%  {line:32s} {split(counter, n)}")
            print("   instructions:")
            for pc, counter in sorted(by_pc.items(), key=lambda kv: -sum(kv[1].values()))[:top]:
                n = sum(counter.values())
                sass = " ".join(action.sass_by_pc(pc).split())
                print(f"   {100 * n / total:5.1f}%  {where(action, pc):28s} {sass[:56]:56s} {split(counter, n, 2)}")


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("reports", nargs="+")
    parser.add_argument("--top", type=int, default=12)
    args = parser.parse_args(argv)
    for path in args.reports:
        report(path, args.top)


if __name__ == "__main__":
    main()

"""`python -m hpctrain nodes [clear [NODE ...]] [--all] [--sbatch] [cluster.bad_nodes=PATH cluster.bad_node_expiry_h=H]`:
the bad-node list (hpctrain.runtime.bad_nodes) — which nodes the next submissions leave out and why — and clearing
it. `--sbatch` prints sbatch's option for them (`--exclude=n2,n7`, or nothing), for a template submitted by hand:
`sbatch $(python -m hpctrain nodes --sbatch) sbatch/train.sbatch ...`."""

from __future__ import annotations

import time

from hpctrain.core.errors import ConfigError, fail


def table(path: str, expiry_h: float, show_all: bool = False, now: float | None = None) -> str:
    """One row per node and reason: records, the last one's time and detail, and whether submissions leave it out."""
    from hpctrain.runtime import bad_nodes

    now = time.time() if now is None else now
    records = bad_nodes.read(path)
    left_out = bad_nodes.excluded(path, expiry_h, now)
    rows = {}
    for r in records:
        live = now - r.at <= expiry_h * 3600
        if live or show_all:
            rows.setdefault((r.node, r.reason), []).append(r)
    if not rows:
        return f"no bad nodes in {path} (records expire after {expiry_h:g} h)"
    lines = [f"bad-node list {path} (records expire after {expiry_h:g} h):",
             f"{'node':12} {'reason':10} {'records':>7}  {'last':19}  {'left out':8}  detail"]
    for (node, reason), rs in sorted(rows.items()):
        last = rs[-1]
        out = "yes" if node in left_out and left_out[node].startswith(reason) else "no"
        lines.append(f"{node:12} {reason:10} {len(rs):>7}  {time.strftime('%Y-%m-%d %H:%M:%S', time.localtime(last.at))}"
                     f"  {out:8}  {last.detail}" + (f" [{last.run}]" if last.run else ""))
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    from hpctrain.core.argparser import Parser
    from hpctrain.runs.compose import compose
    from hpctrain.runtime import bad_nodes

    p = Parser(prog="python -m hpctrain nodes",
               description="The bad-node list: nodes that lost a rank, hung, failed preflight or straggled in two runs, "
                           "which submissions leave out (--exclude) until their records expire.")
    p.add_argument("words", nargs="*", help="`clear [NODE ...]` (every node without names); cluster.* overrides")
    p.add_argument("--all", action="store_true", help="also the expired records")
    p.add_argument("--sbatch", action="store_true",
                   help="print sbatch's --exclude= option for the listed nodes (nothing when none)")
    a = p.parse_args(argv)
    overrides = [w for w in a.words if "=" in w]
    words = [w for w in a.words if "=" not in w]
    if any(not o.startswith("cluster.") for o in overrides):
        fail(f"nodes takes cluster.* keys only, not {next(o for o in overrides if not o.startswith('cluster.'))}")
    if words and words[0] != "clear":
        fail(f"nodes {words[0]!r} is not an action: use `nodes` to list or `nodes clear [NODE ...]`")
    cluster = compose(overrides).cluster
    if not cluster.bad_nodes:
        fail("cluster.bad_nodes is null: there is no bad-node list to show")
    try:
        if a.sbatch:  # (names are checked to look like node names: safe to split unquoted)
            nodes = sorted(bad_nodes.excluded(cluster.bad_nodes, cluster.bad_node_expiry_h))
            print(f"--exclude={','.join(nodes)}" if nodes else "")
        elif words:
            n = bad_nodes.clear(cluster.bad_nodes, words[1:] or None)
            print(f"hpctrain: cleared {n} record{'s' * (n != 1)} from {cluster.bad_nodes}")
        else:
            print(table(cluster.bad_nodes, cluster.bad_node_expiry_h, a.all))
    except (ConfigError, OSError) as e:
        fail(str(e))
    return 0

"""The dashboard's HTML: one page of panels rendered on the server from
`runstats.summary` (commands/status/runstats.py), with inline CSS, inline SVG
charts (commands/status/charts.py) and a small inline script that fetches the
panels again every few seconds and swaps those that changed. No build step,
nothing fetched from elsewhere: the page is whole as served, and a browser
without JavaScript shows it as of its loading.

Every fact a test or a script may want is in the DOM with a stable name: grid
cells carry data-node, data-state, data-pipeline and data-stage; timeline rows
data-type, data-iteration and data-pause; chart points data-it and data-v.
"""
from __future__ import annotations

import json
import time
import zlib
from html import escape

from commands.status import charts


def _clock(t: float | None) -> str:
    return time.strftime("%H:%M:%S", time.localtime(t)) if t else "-"


def _num(v, fmt: str = ".4g", none: str = "-") -> str:
    return none if v is None else f"{v:{fmt}}"


def head(s: dict) -> str:
    counts = s["counts"]
    recoveries = counts["failover"] + counts["redo"] + counts["rollback"]
    badges = "".join(f'<span class="count" data-kind="{k}">{k} <b>{n}</b></span>'
                     for k, n in counts.items() if n)
    done = "-" if s["last_iteration"] is None else s["last_iteration"] + 1
    return (f'<h1>{s["job"]} <span class="state state-{s["state"]}">{s["state"]}</span></h1>'
            f'<p class="facts">{s["model"]}, P={s["stages"]}, M={s["microbatches"]} x batch '
            f'{s["batch"]}; <b id="done">{done}</b> of {s["iterations"]} iterations done; '
            f'<span class="count" data-kind="recoveries">recoveries <b>{recoveries}</b></span> {badges}</p>'
            f'<p class="facts">read from etcd at {_clock(s["at"])}</p>')


def _cell(cell: dict, j: int, s: int) -> str:
    replaced = ""
    if "replaces" in cell:
        old = cell["replaces"]
        replaced = (f'<div class="replaces" data-node="{old["node"]}" data-state="{old["state"]}">'
                    f'in place of node {old["node"]} ({old["state"]})</div>')
    return (f'<td class="cell state-{cell["state"]}" data-node="{cell["node"]}" data-state="{cell["state"]}" '
            f'data-pipeline="{j}" data-stage="{s}"><div class="node">node {cell["node"]} '
            f'<span class="badge">{cell["state"]}</span></div>'
            f'<div class="where">zone {cell["zone"]}, {cell["host"]}</div>'
            f'<div class="holds">{cell["holds"]}</div>{replaced}</td>')


def grid(epoch: dict, current: bool) -> str:
    """One epoch's pipelines x stages table, with its standby nodes."""
    stages = max((len(p) for p in epoch["pipelines"]), default=0)
    rows = "".join(f'<tr><th>pipeline {j}</th>{"".join(_cell(c, j, s) for s, c in enumerate(pipe))}</tr>'
                   for j, pipe in enumerate(epoch["pipelines"]))
    standby = "".join(f'<span class="standby state-{n["state"]}" data-node="{n["node"]}" '
                      f'data-state="{n["state"]}">node {n["node"]} ({n["zone"]}, {n["state"]})</span>'
                      for n in epoch["standby"]) or "none"
    how = f', layers from {epoch["restore"]}' if epoch["redo"] else ""
    table = (f'<table class="grid{" grid-current" if current else " grid-old"}" data-epoch="{epoch["epoch"]}"'
             f'{" id=grid-current" if current else ""}><caption>epoch {epoch["epoch"]}, from iteration '
             f'{epoch["start"]}: {epoch["mode"]} redundancy, sync {epoch.get("sync", "?")}{how}</caption><tr><th></th>'
             + "".join(f"<th>stage {s}</th>" for s in range(stages)) + f"</tr>{rows}</table>"
             f'<p class="standby-list">standby: {standby}</p>')
    return table if current else f'<details><summary>epoch {epoch["epoch"]}</summary>{table}</details>'


def cluster(s: dict) -> str:
    if not s["epochs"]:
        return "<h2>Cluster</h2><p>no configuration yet: the nodes are meeting</p>"
    newest, *older = reversed(s["epochs"])
    gone = [n for n in s["nodes"] if n["state"] in ("dead", "fenced", "left", "draining")]
    left = "".join(f'<li class="gone state-{n["state"]}" data-node="{n["node"]}" data-state="{n["state"]}">'
                   f'node {n["node"]} ({n["zone"]}, {n["host"]}): {n["state"]}</li>' for n in gone)
    return ("<h2>Cluster</h2>" + grid(newest, True) + "".join(grid(e, False) for e in older)
            + (f'<h3>Nodes out of the grid</h3><ul class="gone-list">{left}</ul>' if left else ""))


def run(s: dict) -> str:
    series = s["series"]
    marks = [(e["iteration"], e["type"]) for e in s["events"] if e["iteration"] is not None]
    loss = [(r["iteration"], r["loss"]) for r in series if r["loss"] is not None]
    val = [(r["iteration"], r["val_loss"]) for r in series if r["val_loss"] is not None]
    rate = [(r["iteration"], r["samples_per_second"]) for r in series if r["samples_per_second"]]
    times = [(r["iteration"], r["seconds"]) for r in series if r["seconds"]]
    paused = {e["iteration"]: e["pause"] for e in s["events"] if e["pause"]}
    recent = [r for _, r in rate[-10:]]
    last = series[-1] if series else {}
    facts = (f'loss <b id="last-loss">{_num(last.get("loss"))}</b>, validation loss '
             f'<b>{_num(next((v for _, v in reversed(val)), None))}</b>, '
             f'samples/s <b>{_num(sum(recent) / len(recent) if recent else None, ".3g")}</b> (last 10), '
             f'goodput <b id="goodput">{_num(s["cost"]["goodput"], ".3f")}</b>, usual iteration '
             f'<b>{_num(s["typical_seconds"], ".3g")} s</b>')
    return (f'<h2>Run</h2><p class="facts">{facts}</p>'
            f'<h3>loss (line) and validation loss (squares)</h3>'
            + charts.line("loss", "loss", loss, marks, val)
            + "<h3>samples/s</h3>" + charts.line("rate", "samples/s", rate, marks, fmt=".3g", zero=True)
            + "<h3>iteration time, s (pauses in red)</h3>" + charts.bars("time", "iteration time", times, paused,
                                                                          marks))


def timeline(s: dict) -> str:
    rows = []
    for e in reversed(s["events"]):
        pause = "" if e["pause"] is None else f'{e["pause"]:.3f} s'
        extra = _estimates(e["estimates"]) if e.get("estimates") else ""
        rows.append(f'<tr class="event event-{e["type"]}" data-type="{e["type"]}" '
                    f'data-iteration="{"" if e["iteration"] is None else e["iteration"]}" '
                    f'data-pause="{"" if e["pause"] is None else e["pause"]}">'
                    f'<td>{"-" if e["iteration"] is None else e["iteration"]}</td><td>{_clock(e["time"])}</td>'
                    f'<td><span class="kind" style="border-color:{charts.COLOURS.get(e["type"], "#999")}">'
                    f'{e["type"]}</span></td><td>{e["text"]}{extra}</td><td class="pause">{pause}</td></tr>')
    return ('<h2>Timeline</h2><table class="timeline"><tr><th>iteration</th><th>time</th><th>event</th>'
            '<th>what</th><th>pause</th></tr>' + "".join(rows) + "</table>"
            + (("<h3>auto's estimates now</h3>" + _estimates(s["auto"])) if s["auto"] else ""))


def _estimates(auto: dict) -> str:
    rows = "".join(f'<tr{" class=chosen" if m == auto["chosen"] else ""}><td>{m}</td><td>{v["seconds"]:.3g}</td>'
                   f'<td>{v["pause"]:.3g}</td><td>{v["expected"]:.4g}</td></tr>' for m, v in auto["modes"].items())
    return (f'<table class="estimates" data-iteration="{auto["iteration"]}"><caption>after iteration '
            f'{auto["iteration"]}: {auto["rate_per_node_hour"]:.3g} deaths per node-hour, chose '
            f'{auto["chosen"]}</caption><tr><th>mode</th><th>iteration s</th><th>s per death</th>'
            f'<th>expected s</th></tr>{rows}</table>')


def cost(s: dict) -> str:
    c = s["cost"]
    rows = [("paid node-hours (standby included)", _num(c["node_hours"], ".4g")),
            ("samples (timed iterations)", _num(c["samples"], ".0f")),
            ("goodput (per paid node, of a node's fault-free rate)", _num(c["goodput"], ".3f"))]
    if c["spot_price"] is not None:
        rows += [(f"spot cost so far (${c['spot_price']:g}/node-hour)", _usd(c.get("spot"))),
                 ("spot cost per million samples", _usd(c.get("spot_per_million"))),
                 ("spot cost of the whole job, projected", _usd(c.get("spot_projected")))]
    if c["on_demand_price"] is not None:
        rows += [(f"the same samples on on-demand nodes (${c['on_demand_price']:g}/node-hour)",
                  _usd(c.get("on_demand"))),
                 ("on-demand cost per million samples", _usd(c.get("on_demand_per_million"))),
                 ("on-demand cost of the whole job, projected", _usd(c.get("on_demand_projected")))]
    parts = c.get("ledger") or {}
    if parts:  # where the paid node-hours went (and their dollars, with a price)
        worth = (lambda h: f" ({_usd(h * c['spot_price'])})") if c["spot_price"] is not None else (lambda h: "")
        rows += [(f"node-hours: {part}", _num(hours, ".4g") + worth(hours)) for part, hours in parts.items()]
    rows += _network_rows(c.get("network") or {})
    hint = "" if c["spot_price"] is not None else \
        '<p class="hint">dollars: bamboo-status --serve ... --price SPOT[,ONDEMAND] (per node-hour)</p>'
    return ("<h2>Cost</h2><table class=cost>" + "".join(f"<tr><th>{escape(k)}</th><td>{v}</td></tr>"
                                                        for k, v in rows) + "</table>" + hint)


def _network_rows(n: dict) -> list[tuple[str, str]]:
    """The workers' bytes sent, and those between zones (with --cross-zone-price, their dollars)."""
    if not n.get("sent_bytes"):
        return []
    dollars = f" ({_usd(n['cross_zone_dollars'])})" if n.get("cross_zone_dollars") is not None else ""
    return [("bytes sent (the workers' counters)", _num(n["sent_bytes"] / 1e9, ".4g") + " GB"),
            ("bytes between zones", _num(n["cross_zone_bytes"] / 1e9, ".4g") + " GB" + dollars)]


def _usd(v) -> str:
    return "-" if v is None else f"${v:,.4g}" if v < 100 else f"${v:,.2f}"


PANELS = {"head": head, "cluster": cluster, "run": run, "timeline": timeline, "cost": cost}


def shown(value):
    """`value` (a summary, from records anyone with etcd access may have written)
    with every string in it, keys too, escaped for HTML: the one place the page
    escapes, so no interpolation below can forget to."""
    if isinstance(value, str):
        return escape(value)
    if isinstance(value, dict):
        return {shown(k): shown(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [shown(v) for v in value]
    return value


def panels(s: dict) -> dict[str, str]:
    """Each panel's HTML from the escaped summary. A panel that a malformed record
    breaks (a string where a number belongs) shows "?" and the rest of the page stands."""
    s = shown(s)
    out = {}
    for name, render in PANELS.items():
        try:
            out[name] = render(s)
        except (TypeError, ValueError, KeyError, AttributeError, IndexError) as e:
            out[name] = f'<p class="unreadable" title="{escape(type(e).__name__)}">?</p>'
    return out


def fingerprint(html: str) -> str:
    """What the script compares to know a panel changed."""
    return f"{zlib.crc32(html.encode()):08x}"


def update(s: dict) -> dict:
    """The body of GET /panels: each panel's HTML and fingerprint, and the newest iteration done."""
    shown = panels(s)
    return {"panels": shown, "hashes": {k: fingerprint(v) for k, v in shown.items()},
            "iteration": s["last_iteration"] if isinstance(s["last_iteration"], int) else -1}


def policy(nonce: str) -> str:
    """The Content-Security-Policy of a page served with `nonce`: only its own
    style and script run, it fetches only from where it came, and nothing frames it."""
    return (f"default-src 'none'; script-src 'nonce-{nonce}'; style-src 'nonce-{nonce}'; "
            "style-src-attr 'unsafe-inline'; img-src data:; connect-src 'self'; base-uri 'none'; "
            "form-action 'none'; frame-ancestors 'none'")


def page(s: dict, refresh: float, nonce: str) -> str:
    """The whole page: every panel as of `s`, and the script that keeps them fresh
    (its style and script carry `nonce`, which the response's policy names)."""
    body = "".join(f'<section class="panel" id="panel-{name}" data-html="{fingerprint(html)}">{html}</section>'
                   for name, html in panels(s).items())
    done = s["last_iteration"] if isinstance(s["last_iteration"], int) else -1
    return (f'<!doctype html><html lang="en"><head><meta charset="utf-8"><title>{escape(str(s["job"]))}: '
            f'bamboo</title><meta name="viewport" content="width=device-width, initial-scale=1">'
            f'<style nonce="{nonce}">{CSS}</style></head>'
            f'<body data-polls="0" data-iteration="{done}"><div id="live" class="live">as loaded</div>'
            f'<main>{body}</main><script nonce="{nonce}">const REFRESH = {json.dumps(refresh * 1000)};{SCRIPT}'
            '</script></body></html>')


CSS = """
body{font:14px/1.4 system-ui,sans-serif;margin:0;background:#f6f7f9;color:#222}
main{display:grid;grid-template-columns:repeat(auto-fit,minmax(660px,1fr));gap:12px;padding:12px}
.panel{background:#fff;border:1px solid #dde;border-radius:6px;padding:10px 14px}
#panel-head{grid-column:1/-1} h1{margin:0;font-size:20px} h2{margin:0 0 6px;font-size:16px}
h3{margin:8px 0 2px;font-size:13px;color:#555} .facts{margin:4px 0}
.count{display:inline-block;margin-right:8px;padding:0 6px;border-radius:8px;background:#eef}
.state{font-size:13px;padding:1px 8px;border-radius:8px;background:#ddd}
.state-running{background:#cfe8cf} .state-finished{background:#dde}
table{border-collapse:collapse} td,th{padding:3px 6px;vertical-align:top;text-align:left}
.grid td{border:1px solid #ccd;min-width:130px} caption{text-align:left;color:#555}
.cell .node{font-weight:600} .where,.holds,.replaces{font-size:12px;color:#555}
.badge{font-size:11px;font-weight:400;padding:0 5px;border-radius:6px;background:#ddd}
.state-training{background:#e7f5e7} .state-standby{background:#eef3fb} .state-draining{background:#fff4d6}
.state-dead{background:#fbe3e3} .state-fenced{background:#f3e3d9} .state-left{background:#eee}
.standby,.gone{display:inline-block;margin:2px 6px 2px 0;padding:0 6px;border-radius:6px}
.replaces{color:#a33}
.chart{width:100%;max-width:720px;height:auto;display:block}
.axis{stroke:#999} .tick{font-size:10px;fill:#666} .series{fill:none;stroke:#1f77b4;stroke-width:1.5}
.point{fill:#1f77b4} .extra{fill:#bcbd22} .mark{stroke-width:1.2;stroke-dasharray:3 2}
.bar{fill:#9ecae1} .bar.paused{fill:#d62728}
.timeline td{border-top:1px solid #eee} .kind{border-left:4px solid;padding-left:4px}
.pause{white-space:nowrap;text-align:right} .estimates{font-size:12px;margin-top:4px} .chosen{font-weight:700}
.cost th{font-weight:400;color:#555} .hint{color:#777;font-size:12px}
.live{position:fixed;top:6px;right:10px;font-size:12px;color:#555}
.live.stale{color:#b00}
"""

# Fetches the panels again every REFRESH ms and swaps those whose HTML changed (an
# open <details> stays open while its panel does not change).
SCRIPT = """
(function () {
  const token = new URLSearchParams(location.search).get("token");
  const url = "panels" + (token ? "?token=" + encodeURIComponent(token) : "");
  const live = document.getElementById("live");
  let polls = 0;
  async function poll() {
    try {
      const reply = await fetch(url, {cache: "no-store"});
      if (!reply.ok) throw new Error(reply.status + " " + (await reply.text()).trim());
      const data = await reply.json();
      for (const [name, html] of Object.entries(data.panels)) {
        const panel = document.getElementById("panel-" + name);
        if (panel && panel.dataset.html !== data.hashes[name]) {
          panel.innerHTML = html;
          panel.dataset.html = data.hashes[name];
        }
      }
      polls += 1;
      document.body.dataset.polls = polls;
      document.body.dataset.iteration = data.iteration;
      live.className = "live";
      live.textContent = "live: updated " + new Date().toLocaleTimeString();
    } catch (e) {
      live.className = "live stale";
      live.textContent = "not updated: " + e.message;
    }
    setTimeout(poll, REFRESH);
  }
  setTimeout(poll, REFRESH);
})();
"""

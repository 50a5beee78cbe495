"""The UI's HTML templates (Jinja2, autoescaped), kept in Python so they ship with the code.

Every value from the ledger is printed through autoescaping: an account named
``<script>alert(1)</script>`` renders as that text. Pages also carry a nonce-based
Content-Security-Policy, so even a missed escape could not run a script.
"""

from __future__ import annotations

from jinja2 import DictLoader, Environment, StrictUndefined

from dp_budget_provider.ledger.windows.calendar import display_window

_BASE = """<!doctype html>
<html lang="en">
<head>
<meta charset="utf-8">
<meta name="viewport" content="width=device-width, initial-scale=1">
{% if admin %}<meta name="dp-budget-csrf" content="{{ admin.csrf }}">{% endif %}
<title>{% block title %}DP budget{% endblock %}</title>
<style nonce="{{ nonce }}">
:root { color-scheme: light dark; --fg: #1b1f24; --muted: #5b6470; --line: #d8dee4;
  --bg: #ffffff; --head: #f3f5f8; --ok: #1a7f37; --warn: #9a6700; --bad: #cf222e;
  --bar: #0969da; --link: #0969da; }
@media (prefers-color-scheme: dark) { :root { --fg: #e6edf3; --muted: #9aa5b1;
  --line: #30363d; --bg: #0d1117; --head: #161b22; --link: #4493f8; --bar: #4493f8; } }
* { box-sizing: border-box; }
body { margin: 0; padding: 16px 20px; font: 14px/1.45 system-ui, -apple-system, "Segoe UI",
  Roboto, sans-serif; color: var(--fg); background: var(--bg); }
a { color: var(--link); text-decoration: none; } a:hover { text-decoration: underline; }
h1 { font-size: 20px; margin: 0 0 4px; } h2 { font-size: 16px; margin: 24px 0 8px; }
nav.top { display: flex; gap: 16px; align-items: baseline; flex-wrap: wrap;
  border-bottom: 1px solid var(--line); padding-bottom: 8px; margin-bottom: 12px; }
nav.top .meta { color: var(--muted); font-size: 12px; margin-left: auto; }
table { border-collapse: collapse; width: 100%; }
th, td { border-bottom: 1px solid var(--line); padding: 5px 8px; text-align: left;
  vertical-align: top; }
th { background: var(--head); font-weight: 600; white-space: nowrap; }
td.num, th.num { text-align: right; font-variant-numeric: tabular-nums; }
td.key { max-width: 28ch; white-space: nowrap; overflow: hidden; text-overflow: ellipsis; }
td.nowrap { white-space: nowrap; }
td.attempt { min-width: 22ch; overflow-wrap: anywhere; }
.muted { color: var(--muted); }
.badge { display: inline-block; padding: 0 7px; border-radius: 10px; font-size: 12px;
  font-weight: 600; border: 1px solid currentColor; white-space: nowrap; }
.badge.ok { color: var(--ok); } .badge.WARNING { color: var(--warn); }
.badge.EXHAUSTED { color: var(--bad); } .badge.open { color: var(--warn); }
.bar { vertical-align: middle; } .bar .track { fill: var(--head); stroke: var(--line); }
.bar .fill { fill: var(--bar); } .bar.WARNING .fill { fill: var(--warn); }
.bar.EXHAUSTED .fill { fill: var(--bad); } .small { font-size: 13px; }
form.filters { display: flex; gap: 8px; flex-wrap: wrap; align-items: end; margin: 8px 0 12px; }
form.filters label { display: flex; flex-direction: column; font-size: 12px; color: var(--muted); }
form.filters input, form.filters select { font: inherit; padding: 3px 6px; min-width: 110px;
  color: var(--fg); background: var(--bg); border: 1px solid var(--line); border-radius: 4px; }
button { font: inherit; padding: 4px 12px; border-radius: 4px; border: 1px solid var(--line);
  background: var(--head); color: var(--fg); cursor: pointer; }
.pager { display: flex; gap: 12px; align-items: center; margin: 8px 0; }
.cards { display: grid; grid-template-columns: repeat(auto-fill, minmax(150px, 1fr)); gap: 8px; }
.card { border: 1px solid var(--line); border-radius: 6px; padding: 8px 10px; }
.card .label { font-size: 12px; color: var(--muted); } .card .value { font-size: 18px; }
.verify.ok { color: var(--ok); } .verify.failed { color: var(--bad); }
svg text { fill: var(--muted); font-size: 11px; }
svg.chart { width: 100%; max-width: 960px; height: auto; display: block; }
svg .axis { stroke: var(--line); } svg .grid { stroke: var(--line); stroke-dasharray: 2 3; }
svg .spend { fill: none; stroke: var(--bar); stroke-width: 2; }
svg .dot { fill: var(--bar); }
svg .cap, svg .legend-cap { stroke: var(--bad); stroke-width: 1.5; stroke-dasharray: 6 4; }
svg .warn, svg .legend-warn { stroke: var(--warn); stroke-width: 1.5; stroke-dasharray: 3 3; }
svg .cap-label { fill: var(--bad); } svg .warn-label { fill: var(--warn); }
svg .closing { fill: var(--bg); stroke: var(--bar); stroke-width: 2; }
code { font-size: 12px; }
.error { color: var(--bad); font-weight: 600; }
.warning { color: var(--warn); font-weight: 600; }
.notice { color: var(--ok); font-weight: 600; }
form.admin { display: flex; gap: 8px; flex-wrap: wrap; align-items: end; margin: 8px 0 12px;
  border: 1px solid var(--line); border-radius: 6px; padding: 8px 10px; }
form.admin label { display: flex; flex-direction: column; font-size: 12px; color: var(--muted); }
form.admin input, form.admin select, form.admin textarea { font: inherit; padding: 3px 6px;
  color: var(--fg); background: var(--bg); border: 1px solid var(--line); border-radius: 4px; }
form.admin textarea { width: 100%; min-height: 6em; }
</style>
</head>
<body>
<nav class="top">
  <h1><a href="{{ root }}/accounts">DP budget</a></h1>
  <a href="{{ root }}/accounts">Accounts</a>
  <a href="{{ root }}/policies">Policies</a>
  <a href="{{ root }}/api/report?format=md">Privacy report</a>
  <a href="{{ root }}/openapi.json">API</a>
  {% if admin and admin.key %}<a id="refusal-link" href="{{ root }}/admin/refusal">Refusals</a>
  {% endif %}
  {% if info %}<span class="meta">ledger: {{ info.backend }} · δ = {{ info.delta }}
  · {{ info.conversion }} conversion · history {{ 'keyed' if info.keyed else 'NOT keyed' }}
  · signed in as {{ user }}</span>{% endif %}
</nav>
{% if info and info.quarantine %}
<p id="quarantine" class="error">QUARANTINED since {{ info.quarantine[0] }}: no release runs
  until an operator clears it (<code>dp-budget quarantine clear --reason ...</code>).
  {{ info.quarantine[1] }}</p>
{% if admin and admin.key %}
<form id="clear-quarantine" class="admin" method="post" action="{{ root }}/admin/quarantine/clear">
  <input type="hidden" name="csrf_token" value="{{ admin.csrf }}">
  <label>what the investigation found (audited with your name)
    <input name="reason" required maxlength="2000" size="60"></label>
  <button type="submit">Clear the quarantine</button>
</form>
{% endif %}
{% endif %}
{% if info and info.maintenance %}
<p id="maintenance" class="warning">{{ info.maintenance }}</p>
{% endif %}
{% block body %}{% endblock %}
</body>
</html>
"""

_MACROS = """
{% macro badge(state) -%}
<span class="badge {{ state }}">{{ state }}</span>
{%- endmacro %}
{% macro bar(fraction, state) -%}
<svg class="bar {{ state }}" width="90" height="10" aria-hidden="true">
<rect class="track" x="0.5" y="0.5" width="89" height="9" rx="2"/>
<rect class="fill" x="0.5" y="0.5" height="9" rx="2"
  width="{{ '%.1f' % ([fraction, 1.0] | min * 89) }}"/></svg>
{{ '%.1f' % (fraction * 100) }}%
{%- endmacro %}
{% macro eps(value) -%}{{ '%.4f' % value }}{%- endmacro %}
{% macro subjects(count) -%}
{{ count | thousands }} {{ 'subject' if count == 1 else 'subjects' }}
{%- endmacro %}
{% macro pager(page, pages, total, link, noun) -%}
<div class="pager">
  <span class="muted">{{ total | thousands }} {{ noun }}{% if pages > 1 %}, page {{ page }} of
  {{ pages }}
  {%- endif %}</span>
  {% if page > 1 %}<a href="{{ link(1) }}">« first</a>
  <a href="{{ link(page - 1) }}" rel="prev">‹ previous</a>{% endif %}
  {% if page < pages %}<a href="{{ link(page + 1) }}" rel="next">next ›</a>
  <a href="{{ link(pages) }}">last »</a>{% endif %}
</div>
{%- endmacro %}
{% macro filter_fields(key_fields, filters, states) -%}
  {% for name, label in key_fields %}
  <label>{{ label }}<input name="{{ name }}" value="{{ filters[name] or '' }}"
    placeholder="exact, or * wildcard"></label>
  {% endfor %}
  <label>state<select name="state">
    <option value="">any</option>
    {% for s in states %}<option value="{{ s }}" {% if filters.state == s %}selected{% endif %}>
      {{ s }}</option>{% endfor %}
  </select></label>
{%- endmacro %}
{% macro per_page_field(page_sizes, per_page) -%}
  <label>per page<select name="per_page">
    {% for n in page_sizes %}<option value="{{ n }}" {% if per_page == n %}selected{% endif %}>
      {{ n }}</option>{% endfor %}
  </select></label>
{%- endmacro %}
{% macro column_headers(columns, sort=none, order=none, sort_link=none) -%}
<thead><tr>
  {% for column, label, numeric in columns %}
  <th class="{{ 'num' if numeric }}">{% if column %}<a href="{{ sort_link(column) }}">{{ label }}
  {%- if sort == column %} {{ '▲' if order == 'asc' else '▼' }}{% endif %}</a>
  {%- else %}{{ label }}{% endif %}</th>
  {% endfor %}
</tr></thead>
{%- endmacro %}
{% macro status_cells(a) -%}
  <td class="num">{{ eps(a.epsilon) }}</td>
  <td class="num held">{{ eps(a.held_epsilon) }}</td>
  <td class="num">{{ '%g' % a.cap_epsilon }}</td>
  <td class="num remaining">{{ eps(a.remaining_after_held) }}</td>
  <td class="nowrap">{{ bar(a.fraction, a.state) }}</td>
  <td>{{ badge(a.state) }}</td>
  <td class="num">{% if a.open_reservations %}<span class="badge open">
    {{ a.open_reservations }} open</span>{% else %}0{% endif %}</td>
  <td class="num">{{ a.releases }}</td>
  <td class="muted nowrap">{{ a.updated_at | when }}</td>
{%- endmacro %}
"""

_ACCOUNTS = """{% extends "base.html" %}
{% from "macros.html" import column_headers, filter_fields, pager, per_page_field, status_cells %}
{% block title %}DP budget · accounts{% endblock %}
{% block body %}
<p class="views">Per subject · <a id="by-class" href="{{ classes_link }}">by spend class</a></p>
<form class="filters" method="get" action="{{ root }}/accounts">
  {{ filter_fields(key_fields, filters, states) }}
  <label>sort<select name="sort">
    {% for s in sorts %}<option value="{{ s }}" {% if sort == s %}selected{% endif %}>{{ s }}
    </option>{% endfor %}
  </select></label>
  <label>order<select name="order">
    <option value="asc" {% if order == 'asc' %}selected{% endif %}>ascending</option>
    <option value="desc" {% if order == 'desc' %}selected{% endif %}>descending</option>
  </select></label>
  {{ per_page_field(page_sizes, per_page) }}
  <button type="submit">Apply</button> <a href="{{ root }}/accounts">reset</a>
</form>
{% if error %}<p class="error" role="alert">{{ error }}</p>{% endif %}
{{ pager(page, pages, total, page_link, "accounts") }}
<table id="accounts">
{{ column_headers(columns, sort, order, sort_link) }}
<tbody>
{% for a in accounts %}
<tr>
  <td class="key" title="{{ a.key.tenant }}">{{ a.key.tenant }}</td>
  <td class="key" title="{{ a.key.subject }}"><a href="{{ account_link(a.key) }}">
    {{- a.key.subject }}</a></td>
  <td class="key" title="{{ a.key.query_type }}">{{ a.key.query_type }}</td>
  <td class="key" title="{{ a.key.window | window }}">{{ a.key.window | window }}</td>
  {{ status_cells(a) }}
</tr>
{% else %}
<tr><td colspan="{{ columns | length }}" class="muted">No accounts match.</td></tr>
{% endfor %}
</tbody>
</table>
{{ pager(page, pages, total, page_link, "accounts") }}
{% endblock %}
"""

_CLASSES = """{% extends "base.html" %}
{% from "macros.html" import column_headers, filter_fields, pager, per_page_field, status_cells,
  subjects %}
{% block title %}DP budget · spend classes{% endblock %}
{% block body %}
<p class="views"><a id="per-subject" href="{{ accounts_link }}">Per subject</a> · by spend class
</p>
<p class="muted">A spend class is the subjects of one window that every release so far has
covered alike: they hold the same spend, shown once. A subject filter finds the classes of the
matching subjects (and counts only those).</p>
<form class="filters" method="get" action="{{ root }}/classes">
  {{ filter_fields(key_fields, filters, states) }}
  {{ per_page_field(page_sizes, per_page) }}
  <button type="submit">Apply</button> <a href="{{ root }}/classes">reset</a>
</form>
{% if error %}<p class="error" role="alert">{{ error }}</p>{% endif %}
{{ pager(page, pages, total, page_link, "classes") }}
<table id="classes">
{{ column_headers(columns) }}
<tbody>
{% for c in classes %}
{% set a = c.status %}
<tr>
  <td class="key" title="{{ a.key.tenant }}">{{ a.key.tenant }}</td>
  <td class="key" title="{{ a.key.query_type }}">{{ a.key.query_type }}</td>
  <td class="key" title="{{ a.key.window | window }}">{{ a.key.window | window }}</td>
  <td class="num subjects">{{ subjects(c.subjects) }}</td>
  <td class="key" title="{{ a.key.subject }}"><a href="{{ account_link(a.key) }}">
    {{- a.key.subject }}</a></td>
  {{ status_cells(a) }}
  <td><a class="members" href="{{ members_link(c) }}">members</a></td>
</tr>
{% else %}
<tr><td colspan="{{ columns | length }}" class="muted">No classes match.</td></tr>
{% endfor %}
</tbody>
</table>
{{ pager(page, pages, total, page_link, "classes") }}
{% endblock %}
"""

_MEMBERS = """{% extends "base.html" %}
{% from "macros.html" import column_headers, eps, pager, status_cells, subjects %}
{% block title %}DP budget · spend class {{ class_id }}{% endblock %}
{% block body %}
<p><a href="{{ classes_link }}">Spend classes</a> ›
  <span class="key" id="class-scope">{{ scope.tenant }} / {{ scope.query_type }} /
  {{ scope.window | window }}</span> › class <code>{{ class_id }}</code></p>
{% if members %}
{% set a = members[0] %}
<p id="class-summary">{{ subjects(total) }}, ε {{ eps(a.epsilon) }} spent of
  {{ '%g' % a.cap_epsilon }} (held {{ eps(a.held_epsilon) }}), {{ a.state }}; each member
  holds this spend.</p>
{% endif %}
{{ pager(page, pages, total, page_link, "subjects") }}
<table id="members">
{{ column_headers(columns) }}
<tbody>
{% for a in members %}
<tr>
  <td class="key" title="{{ a.key.subject }}"><a href="{{ account_link(a.key) }}">
    {{- a.key.subject }}</a></td>
  {{ status_cells(a) }}
</tr>
{% else %}
<tr><td colspan="{{ columns | length }}" class="muted">No members on this page.</td></tr>
{% endfor %}
</tbody>
</table>
{{ pager(page, pages, total, page_link, "subjects") }}
{% endblock %}
"""

_ACCOUNT = """{% extends "base.html" %}
{% from "macros.html" import badge, bar, eps, pager, subjects %}
{% block title %}DP budget · {{ key.subject }}{% endblock %}
{% macro attempt(attempt_id) -%}
{%- if not attempt_id %}—{% elif task_link(attempt_id) -%}
<a href="{{ task_link(attempt_id) }}" target="_top">{{ attempt_id }}</a>
{%- else %}{{ attempt_id }}{% endif -%}
{%- endmacro %}
{% macro legend_entry(entry, kind, label) -%}
<line class="legend-{{ kind }}" x1="{{ entry.x }}" x2="{{ entry.label_x - 6 }}"
    y1="{{ entry.y - 5 }}" y2="{{ entry.y - 5 }}"/>
  <text class="{{ kind }}-label" x="{{ entry.label_x }}" y="{{ entry.y }}">{{ label }}</text>
{%- endmacro %}
{% block body %}
<p><a href="{{ root }}/accounts">Accounts</a> ›
  <span class="key" id="account-key">{{ key.tenant }} / {{ key.subject }} /
  {{ key.query_type }} / {{ key.window | window }}</span></p>
{% if account %}
<div class="cards">
  <div class="card"><div class="label">ε spent</div>
    <div class="value" id="epsilon">{{ eps(account.epsilon) }}</div></div>
  <div class="card"><div class="label">cap (δ = {{ info.delta }})</div>
    <div class="value">{{ '%g' % account.cap_epsilon }}</div></div>
  <div class="card"><div class="label">ε held (open reservations charged)</div>
    <div class="value" id="held-epsilon">{{ eps(account.held_epsilon) }}</div></div>
  <div class="card"><div class="label">remaining after held</div>
    <div class="value" id="remaining">{{ eps(account.remaining_after_held) }}</div></div>
  <div class="card"><div class="label">used</div>
    <div class="value">{{ bar(account.fraction, state) }}</div></div>
  <div class="card"><div class="label">state</div><div class="value">{{ badge(state) }}</div></div>
  <div class="card"><div class="label">releases</div>
    <div class="value">{{ account.releases }}</div></div>
  <div class="card"><div class="label">open reservations</div>
    <div class="value">{{ account.open_reservations }}</div></div>
  <div class="card"><div class="label">bound</div>
    <div class="value small">{{ account.method }}</div></div>
  <div class="card" id="class-size"><div class="label">spend class</div>
    <div class="value small">{{ subjects(account.subjects) }} at this spend</div></div>
</div>
{% else %}
<p class="muted">This key has no live account (never charged, reset with its window, or
re-scoped); its history is below.</p>
{% endif %}
{% if totals %}
<h2>This subject's totals</h2>
<table id="totals">
<tr><th>scope</th><th>period</th><th class="num">ε</th><th class="num">cap</th>
  <th class="num">remaining after held</th><th>state</th></tr>
{% for total in totals %}
<tr><td><a href="{{ account_link(total.key) }}">{{ total.key.query_type }}</a></td>
  <td>{{ total.key.window | window }}</td><td class="num">{{ eps(total.epsilon) }}</td>
  <td class="num">{{ '%g' % total.cap_epsilon }}</td>
  <td class="num">{{ eps(total.remaining_after_held) }}</td>
  <td>{{ badge(total.state) }}</td></tr>
{% endfor %}
</table>
{% endif %}

<h2>Cumulative ε over time</h2>
{% if chart %}
<svg id="spend-chart" role="img" class="chart" preserveAspectRatio="xMinYMin meet"
  viewBox="0 0 {{ chart.width }} {{ chart.height }}"
  aria-label="cumulative epsilon of this account over time, with its cap and warning line">
  {% for t in chart.y_ticks %}
  <line class="grid" x1="{{ chart.left }}" x2="{{ chart.right }}" y1="{{ t.position }}"
    y2="{{ t.position }}"/>
  <text x="{{ chart.left - 6 }}" y="{{ t.position + 4 }}" text-anchor="end">{{ t.label }}</text>
  {% endfor %}
  {% for t in chart.x_ticks %}
  <text x="{{ t.position }}" y="{{ chart.bottom + 16 }}"
    text-anchor="{{ 'start' if loop.first else ('end' if loop.last else 'middle') }}">
    {{ t.label }}</text>
  {% endfor %}
  <line class="axis" x1="{{ chart.left }}" x2="{{ chart.left }}" y1="{{ chart.top }}"
    y2="{{ chart.bottom }}"/>
  <line class="axis" x1="{{ chart.left }}" x2="{{ chart.right }}" y1="{{ chart.bottom }}"
    y2="{{ chart.bottom }}"/>
  <line class="cap" x1="{{ chart.left }}" x2="{{ chart.right }}" y1="{{ chart.cap_y }}"
    y2="{{ chart.cap_y }}"/>
  <line class="warn" x1="{{ chart.left }}" x2="{{ chart.right }}" y1="{{ chart.warn_y }}"
    y2="{{ chart.warn_y }}"/>
  {{ legend_entry(chart.cap_legend, "cap", "cap ε = %g" % chart.cap) }}
  {{ legend_entry(chart.warn_legend, "warn", "warning at ε = %g" % chart.warn) }}
  <path class="spend" d="{{ chart.path }}"/>
  {% for d in chart.dots %}
  <circle class="{{ 'closing' if d.closing else 'dot' }}" cx="{{ d.x }}" cy="{{ d.y }}"
    r="{{ 4.5 if d.closing else 2.5 }}"><title>#{{ d.seq }} {{ d.action }}
    {{ d.at }}: ε = {{ eps(d.epsilon) }}</title></circle>
  {% endfor %}
  <text x="{{ chart.left - 40 }}" y="{{ chart.top + 2 }}">ε</text>
</svg>
<p class="muted">{{ series.events }} charge event(s){% if series.events > series.points | length %},
{{ series.points | length }} of them drawn (evenly spaced, first and last included){% endif %}.
{% for d in chart.dots if d.closing %}
The account ended at #{{ d.seq }} ({{ d.action }}, ringed) at ε = {{ eps(d.epsilon) }}:
nothing was refunded, so the line stays level.
{% endfor %}</p>
{% else %}
<p class="muted">Nothing charged yet.</p>
{% endif %}

<h2>Audit</h2>
<p id="verification" class="verify {{ verification.state }}" data-url="{{ root }}/api/verification"
  {% if verification.state == 'pending' %}data-pending="1"{% endif %}>
  {%- if verification.state == 'ok' -%}
  Verified: {{ verification.entries }} history entries and {{ verification.accounts }}
  accounts check out (as of entry #{{ verification.head_seq }}).
  {%- elif verification.state == 'failed' -%}
  Verification FAILED: {{ verification.problems | length }} problem(s).
  {%- else -%}
  Verifying the ledger…
  {%- endif -%}
</p>
<ul id="verification-problems">
{% for p in verification.problems[:20] %}<li>{{ p }}</li>{% endfor %}
</ul>
<ul id="verification-notes" class="muted">
{% for n in verification.get('notes', [])[:20] %}<li>note: {{ n }}</li>{% endfor %}
</ul>
<script nonce="{{ nonce }}">
(function () {
  var box = document.getElementById("verification");
  if (!box || !box.dataset.pending) { return; }
  fetch(box.dataset.url, {credentials: "same-origin", headers: {"Accept": "application/json"}})
    .then(function (r) { if (!r.ok) { throw new Error("HTTP " + r.status); } return r.json(); })
    .then(function (v) {
      box.className = "verify " + (v.ok ? "ok" : "failed");
      box.textContent = v.ok
        ? "Verified: " + v.entries + " history entries and " + v.accounts +
          " accounts check out (as of entry #" + v.head_seq + ")."
        : "Verification FAILED: " + v.problems.length + " problem(s).";
      var list = document.getElementById("verification-problems");
      v.problems.slice(0, 20).forEach(function (p) {
        var item = document.createElement("li"); item.textContent = p; list.appendChild(item);
      });
      var notes = document.getElementById("verification-notes");
      (v.notes || []).slice(0, 20).forEach(function (n) {
        var item = document.createElement("li"); item.textContent = "note: " + n;
        notes.appendChild(item);
      });
    })
    .catch(function (e) { box.className = "verify failed";
      box.textContent = "Verification could not run: " + e.message; });
})();
</script>

<h2>Policy</h2>
<table id="policy">
<tr><th>scope</th><td>tenant {{ policy.tenant }}, query type {{ policy.query_type }}</td></tr>
<tr><th>cap</th><td>ε = {{ '%g' % policy.cap_epsilon }} at δ = {{ info.delta }}</td></tr>
<tr><th>warning</th><td>at {{ '%g' % (policy.warn_fraction * 100) }}% of the cap</td></tr>
<tr><th>windows</th><td>{{ policy.calendar.label }}, minimum
  {{ policy.min_window.total_seconds() | int }} s</td></tr>
<tr><th>compliance clause</th><td>{{ policy.compliance_clause or '—' }}</td></tr>
</table>

<h2>Reservations</h2>
{{ pager(reservations_page, reservations_pages, reservations.total, reservations_link,
  "reservations") }}
<table id="reservations">
<thead><tr><th>created</th><th>state</th><th>task attempt</th><th>mechanism</th>
  <th class="num">count</th><th class="num">subjects</th><th class="num">cost ε alone</th>
  <th class="num">prospective ε</th><th>actor</th><th>resolved</th></tr></thead>
<tbody>
{% for r in reservations.items %}
<tr>
  <td class="nowrap"><a href="{{ release_link(r.id) }}">{{ r.created_at | when }}</a></td>
  <td><span class="badge {{ 'open' if r.state == 'open' else '' }}">{{ r.state }}</span></td>
  <td class="attempt">{{ attempt(r.attempt_id) }}</td>
  <td><code>{{ describe(r.mechanism) }}</code></td>
  <td class="num">{{ r.count }}</td>
  <td class="num">{{ '{:,}'.format(r.subjects) }}</td>
  <td class="num">{{ eps(r.cost_epsilon) }}</td>
  <td class="num">{{ eps(r.prospective_epsilon) }}</td>
  <td>{{ r.actor }}</td>
  <td class="muted nowrap">{{ (r.resolved_at | when) if r.resolved_at else '—' }}</td>
</tr>
{% else %}
<tr><td colspan="10" class="muted">No reservations.</td></tr>
{% endfor %}
</tbody>
</table>

<h2>History</h2>
{{ pager(history_page, history_pages, history.total, history_link, "entries") }}
<table id="history">
<thead><tr><th class="num">#</th><th>time</th><th>action</th><th>task attempt</th>
  <th>mechanism</th><th class="num">count</th><th class="num">cost ε alone</th><th>actor</th>
  <th class="num">subjects</th><th>note</th></tr></thead>
<tbody>
{% for e in history.items %}
<tr>
  <td class="num">{{ e.seq }}</td>
  <td class="muted nowrap">{{ e.at | when }}</td>
  <td>{{ e.action }}</td>
  <td class="attempt">{{ attempt(e.attempt_id) }}</td>
  <td>{% if e.mechanism %}<code>{{ describe(e.mechanism) }}</code>{% else %}—{% endif %}</td>
  <td class="num">{{ e.count or '—' }}</td>
  <td class="num">{% if e.cost_epsilon is not none %}{{ eps(e.cost_epsilon) }}{% else %}—
    {%- endif %}</td>
  <td>{{ e.actor }}</td>
  <td class="num">{{ '{:,}'.format(e.subjects) if e.subjects is not none else '—' }}</td>
  <td>{{ e.note or '' }}</td>
</tr>
{% else %}
<tr><td colspan="10" class="muted">No history entries for this key.</td></tr>
{% endfor %}
</tbody>
</table>
{% endblock %}
"""

_RELEASE = """{% extends "base.html" %}
{% from "macros.html" import eps, pager, subjects %}
{% block title %}DP budget · release{% endblock %}
{% block body %}
{% set r = release.reservation %}
<h1>Release <code>{{ r.id }}</code></h1>
<table id="release">
<tr><th>state</th><td><span class="badge {{ 'open' if r.state == 'open' else '' }}">
  {{ r.state }}</span></td></tr>
<tr><th>task attempt</th><td class="attempt">{% if task_link(r.attempt_id) %}
  <a href="{{ task_link(r.attempt_id) }}" target="_top">{{ r.attempt_id }}</a>
  {%- else %}{{ r.attempt_id }}{% endif %}</td></tr>
<tr><th>mechanism</th><td><code>{{ describe(r.mechanism) }}</code> × {{ r.count }}</td></tr>
<tr><th>cost ε alone</th><td>{{ eps(r.cost_epsilon) }}</td></tr>
<tr><th>covers</th><td>{{ subjects(r.subjects) }} in {{ r.key_count | thousands }}
  {{ 'account' if r.key_count == 1 else 'accounts' }}</td></tr>
<tr><th>windows</th><td>{% for w in release.windows %}<code>{{ w | window }}</code>
  {% endfor %}</td></tr>
<tr><th>reserved</th><td>{{ r.created_at | when }} by {{ r.actor }}</td></tr>
<tr><th>resolved</th><td>{{ (r.resolved_at | when) if r.resolved_at else '—' }}</td></tr>
</table>

<h2>Accounts it held</h2>
<p class="muted">A spend class's account covers every subject of the class: its page lists
them.</p>
{{ pager(page, pages, release.accounts.total, page_link, "accounts") }}
<table id="accounts">
<thead><tr><th>tenant</th><th>subject or spend class</th><th>query type</th><th>window</th>
</tr></thead>
<tbody>
{% for key in release.accounts.items %}
<tr><td>{{ key.tenant }}</td>
  <td><a href="{{ account_link(key) }}">{{ key.subject }}</a></td>
  <td>{{ key.query_type }}</td><td><code>{{ key.window | window }}</code></td></tr>
{% else %}
<tr><td colspan="4" class="muted">No accounts on this page.</td></tr>
{% endfor %}
</tbody>
</table>
{% endblock %}
"""

_POLICIES = """{% extends "base.html" %}
{% block title %}DP budget · policies{% endblock %}
{% block body %}
<h2>Policies</h2>
<p class="muted">The most specific scope applies: tenant and query type, then tenant, then query
type, then the default (* / *). δ = {{ info.delta }} for the whole ledger.</p>
{% if notice %}<p id="notice" class="notice" role="status">{{ notice }}</p>{% endif %}
{% if error %}<p id="error" class="error" role="alert">{{ error }}</p>{% endif %}
<table id="policies">
<thead><tr><th>tenant</th><th>query type</th><th class="num">cap ε</th><th>warning at</th>
  <th>windows</th><th>minimum window</th><th>grace</th><th>filter order</th>
  <th>shares</th><th>compliance clause</th></tr></thead>
<tbody>
{% for p in policies %}
<tr><td>{{ p.tenant }}</td><td>{{ p.query_type }}</td>
  <td class="num">{{ '%g' % p.cap_epsilon }}</td>
  <td>{{ '%g' % (p.warn_fraction * 100) }}%</td>
  <td>{{ p.calendar.label }}</td>
  <td>{{ p.min_window.total_seconds() | int }} s</td><td>{{ p.grace.total_seconds() | int }} s</td>
  <td>{{ '%g' % p.filter_order if p.filter_order else 'reported' }}</td>
  <td class="shares">{% for s in p.shares %}<span title="DAGs: {{ s.dags | join(', ') }};
    cap ε {{ '%g' % s.cap_epsilon }}">{{ s.principal }} {{ '%g' % (s.fraction * 100) }}%</span>
    {%- if not loop.last %}, {% endif %}{% else %}—{% endfor %}</td>
  <td>{{ p.compliance_clause or '—' }}</td></tr>
{% endfor %}
</tbody>
</table>
{% if admin and admin.key %}
<h2>Set a policy</h2>
<p class="muted">Creates or replaces one scope's policy, signed with this server's administrator
key and audited with your name. Fields left empty keep the scope's current values (a new scope
needs its cap). A charged scope keeps its calendar.</p>
<form id="set-policy" class="admin" method="post" action="{{ root }}/admin/policy">
  <input type="hidden" name="csrf_token" value="{{ admin.csrf }}">
  <label>tenant <input name="tenant" value="*" required></label>
  <label>query type <input name="query_type" value="*" required></label>
  <label>cap ε <input name="cap_epsilon" inputmode="decimal"></label>
  <label>warning fraction <input name="warn_fraction" inputmode="decimal"></label>
  <label>calendar <select name="calendar"><option value="">(keep)</option>
    {% for kind in ("iso_week", "month", "day", "fixed") %}<option>{{ kind }}</option>{% endfor %}
  </select></label>
  <label>fixed window length (s) <input name="length_seconds" inputmode="numeric"></label>
  <label>minimum window (s) <input name="min_window_seconds" inputmode="numeric"></label>
  <label>grace (s) <input name="grace_seconds" inputmode="numeric"></label>
  <label>compliance clause <input name="compliance_clause" size="40"></label>
  <label>a cap across <select name="across"><option value="">(one query type)</option>
    <option value="query_types">query types, per window</option>
    <option value="windows">windows, per horizon</option></select></label>
  <label>horizon (windows) <input name="horizon_windows" inputmode="numeric"></label>
  <label>filter order <input name="filter_order" placeholder="auto"></label>
  <label>shares <input name="shares" size="40"
    placeholder="analytics=0.5:etl_a,etl_b; growth=0.3:etl_g (or none)"></label>
  <button type="submit">Set policy</button>
</form>
{% elif admin %}
<p id="no-admin-key" class="muted">Administrator's acts are not offered: this api-server holds no
administrator key (<code>[dp_budget] admin_key_file</code>). Use <code>dp-budget --admin-key
FILE policy set</code>.</p>
{% endif %}
{% endblock %}
"""

_MESSAGE = """{% extends "base.html" %}
{% block title %}DP budget · {{ heading }}{% endblock %}
{% block body %}
<h2>{{ heading }}</h2>
<p class="error" role="alert">{{ message }}</p>
{% if login_url %}<p><a href="{{ login_url }}" target="_top">Sign in to Airflow</a></p>{% endif %}
{% if back %}<p><a id="back" href="{{ back[0] }}">{{ back[1] }}</a></p>{% endif %}
{% endblock %}
"""

_REFUSAL = """{% extends "base.html" %}
{% block title %}DP budget · refusal reference{% endblock %}
{% block body %}
<h2>Open a refusal reference</h2>
<p class="muted">A refused release tells its task only a reference (<code>dpb-ref-1.…</code>):
paste it here to see which account refused it and why. Only this server's administrator key
opens it.</p>
{% if error %}<p id="error" class="error" role="alert">{{ error }}</p>{% endif %}
<form id="open-refusal" class="admin" method="post" action="{{ root }}/admin/refusal">
  <input type="hidden" name="csrf_token" value="{{ admin.csrf if admin else '' }}">
  <label>reference <textarea name="reference" required maxlength="8192"></textarea></label>
  <button type="submit">Open</button>
</form>
{% if opened %}
<table id="refusal">
<tbody>
{% for name, value in opened.facts.items() %}
<tr><th>{{ name }}</th><td>
  {%- if name == "account" and opened.account_url %}<a id="refusal-account"
    href="{{ opened.account_url }}">{{ value.tenant }} / {{ value.subject }} /
    {{ value.query_type }} / {{ value.window | window }}</a>
  {%- else %}{{ value }}{% endif %}</td></tr>
{% endfor %}
</tbody>
</table>
{% endif %}
{% endblock %}
"""

TEMPLATES = {
    "base.html": _BASE,
    "macros.html": _MACROS,
    "accounts.html": _ACCOUNTS,
    "classes.html": _CLASSES,
    "members.html": _MEMBERS,
    "account.html": _ACCOUNT,
    "release.html": _RELEASE,
    "policies.html": _POLICIES,
    "message.html": _MESSAGE,
    "refusal.html": _REFUSAL,
}


def when(stamp: str) -> str:
    """``2026-07-14T12:00:00.123456Z`` as ``2026-07-14 12:00:00Z`` (the ledger's UTC stamps)."""
    return f"{stamp[:10]} {stamp[11:19]}Z" if len(stamp) >= 19 and stamp[10] == "T" else stamp


def thousands(count: int) -> str:
    """``48211`` as ``48,211``: class sizes and totals read at a glance."""
    return f"{count:,}"


def environment() -> Environment:
    """The template environment: autoescape on for every template, undefined names fail."""
    env = Environment(
        loader=DictLoader(TEMPLATES),
        autoescape=True,
        undefined=StrictUndefined,
        trim_blocks=True,
        lstrip_blocks=True,
    )
    env.filters["when"] = when
    env.filters["thousands"] = thousands
    env.filters["window"] = display_window
    return env

// forkd web console: the lineage of snapshots, branches and sandboxes from the HTTP API,
// with the daemon's token (kept in this module's memory only), and the actions fork N,
// branch, kill, delete and exec. Plain DOM, no framework.
//
// The lists are fetched again when the daemon's event stream says something changed
// (one long request, not a poll a second: every request is a line in the audit log),
// and every 30 s in case the stream missed something; ages are redrawn locally. What
// each sandbox uses (GET /v1/sandboxes/metrics: host CPU and memory, the guest's memory)
// is fetched every 10 s and on changes; reading it wakes and touches no sandbox.
// The network panel shows one sandbox's policy (GET .../network) and what it reached
// and was refused through the egress proxy (GET .../egress), updated on its egress
// events, and can cut it off or open it; secrets are listed by name and hosts only.
// The webhooks panel lists the endpoints events are delivered to with their latest
// deliveries (refreshed with the tree), adds one (its secret shown once), tests and
// removes them.

let token = null;
let timers = [];
let lists = { snapshots: [], sandboxes: [], usage: new Map() };
let pending = null;
let watched = null;  // the sandbox the network panel shows
let pendingNet = null;
let pendingHooks = null;  // a refresh of the webhooks panel while deliveries wait
const $ = (id) => document.getElementById(id);

async function api(method, path, body) {
  const headers = { Authorization: `Bearer ${token}`, Accept: "application/json" };
  if (body !== undefined) headers["Content-Type"] = "application/json";
  const resp = await fetch(path, { method, headers, body: body === undefined ? undefined : JSON.stringify(body) });
  const text = await resp.text();
  const data = text ? JSON.parse(text) : null;
  if (!resp.ok) throw new Error(`${resp.status}: ${data?.error ?? text}`);
  return data;
}

function el(tag, attrs = {}, ...children) {
  const node = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs)) {
    if (k === "class") node.className = v;
    else if (k.startsWith("on")) node.addEventListener(k.slice(2), v);
    else node.setAttribute(k, v);
  }
  for (const c of children) node.append(c instanceof Node ? c : document.createTextNode(String(c)));
  return node;
}

function duration(secs) {
  const s = Math.max(0, Math.round(secs));
  return s < 90 ? `${s} s` : s < 5400 ? `${Math.round(s / 60)} min` : `${Math.round(s / 3600)} h`;
}

const age = (unix) => duration(Date.now() / 1000 - unix);

function say(text, isError = false) {
  const status = $("status");
  status.textContent = text;
  status.classList.toggle("error", isError);
}

async function act(label, fn) {
  try {
    say(`${label}…`);
    await fn();
    say(`${label}: done`);
  } catch (err) {
    say(`${label}: ${err.message}`, true);
  }
  await refresh();
}

// An explore's marks (labels forkd.variant, forkd.score; docs/API.md, "Explore").
function searchMarks(labels) {
  const marks = [];
  if (labels?.["forkd.variant"] !== undefined) marks.push(`variant ${labels["forkd.variant"]}`);
  else if (labels?.["forkd.explore"] !== undefined) marks.push("explore");
  if (labels?.["forkd.score"] !== undefined) marks.push(`score ${labels["forkd.score"]}`);
  return marks.length ? el("span", { class: "badge search" }, marks.join(" · ")) : "";
}

const MIB = 1 << 20;

function usageText(m) {
  if (!m) return "";
  const parts = [];
  if (m.cpu?.percent !== null && m.cpu?.percent !== undefined) parts.push(`cpu ${m.cpu.percent}%`);
  if (m.memory?.host_private_bytes) parts.push(`host ${Math.round(m.memory.host_private_bytes / MIB)} MiB`);
  if (m.memory?.guest_used_bytes) parts.push(`guest ${Math.round(m.memory.guest_used_bytes / MIB)} MiB`);
  if (m.wakes) parts.push(`woken ${m.wakes}×`);
  if (m.evictions) parts.push(`evicted ${m.evictions}×`);
  return parts.join(" · ");
}

function sandboxNode(sb) {
  return el("li", { class: "node sandbox", "data-sandbox": sb.id },
    el("div", { class: "row" },
      el("span", { class: "tag" }, sb.id),
      el("span", { class: `badge state-${sb.state}` }, sb.state),
      searchMarks(sb.metadata),
      el("span", { class: "meta" }, `fork ${sb.fork_ms ?? "–"} ms · ${age(sb.created_at_unix)} old` +
        (sb.memory_limit_mib ? ` · ≤ ${sb.memory_limit_mib} MiB` : "") +
        (sb.branch_count ? ` · ${sb.branch_count} branch${sb.branch_count > 1 ? "es" : ""}` : "")),
      el("span", { class: "meta usage" }, usageText(lists.usage.get(sb.id))),
      el("button", { onclick: () => act(`branch ${sb.id}`, () => api("POST", `/v1/sandboxes/${encodeURIComponent(sb.id)}/branch`, {})) }, "branch"),
      el("button", { onclick: () => showNetwork(sb.id) }, "network"),
      el("button", { class: "danger", onclick: () => act(`kill ${sb.id}`, () => api("DELETE", `/v1/sandboxes/${encodeURIComponent(sb.id)}`)) }, "kill"),
    ));
}

function snapshotNode(node) {
  const s = node.snapshot;
  const n = el("input", { class: "n", type: "number", min: "1", max: "100", value: "1", "aria-label": `children of ${s.tag}` });
  const meta = [s.mode ?? "full", s.status, `${s.memory_mib} MiB`, `${age(s.created_at_unix)} old`];
  if (s.pause_ms !== undefined && s.pause_ms !== null) meta.push(`paused ${s.pause_ms} ms`);
  return el("li", { class: "node snapshot", "data-snapshot": s.tag },
    el("div", { class: "row" },
      el("span", { class: "tag" }, s.tag),
      searchMarks(s.metadata),
      el("span", { class: "meta" }, meta.join(" · ")),
      n,
      el("button", { onclick: () => act(`fork ${n.value} from ${s.tag}`, () => api("POST", "/v1/sandboxes", { snapshot_tag: s.tag, n: Number(n.value) })) }, "fork"),
      el("button", { class: "danger", onclick: () => act(`delete ${s.tag}`, () => api("DELETE", `/v1/snapshots/${encodeURIComponent(s.tag)}`)) }, "delete"),
    ),
    el("ul", {}, ...node.sandboxes.map(sandboxNode), ...node.children.map(snapshotNode)));
}

function lineage(snapshots, sandboxes) {
  const nodes = new Map(snapshots.map((s) => [s.tag, { snapshot: s, sandboxes: [], children: [] }]));
  for (const sb of sandboxes) nodes.get(sb.snapshot_tag)?.sandboxes.push(sb);
  const roots = [];
  for (const s of snapshots) (nodes.get(s.parent_tag ?? "")?.children ?? roots).push(nodes.get(s.tag));
  return roots;
}

function render() {
  const { snapshots, sandboxes } = lists;
  $("tree").replaceChildren(...lineage(snapshots, sandboxes).map(snapshotNode));
  const select = $("exec-sandbox");
  const chosen = select.value;
  // A paused or hibernated sandbox wakes for the command (unless made with auto_resume false).
  const awake = (s) => s.state === "running" || (s.auto_resume && (s.state === "paused" || s.state === "hibernated"));
  select.replaceChildren(...sandboxes.filter(awake).map((s) => el("option", { value: s.id }, s.id)));
  if ([...select.options].some((o) => o.value === chosen)) select.value = chosen;
}

async function refresh() {
  if (!token) return;
  refreshNetwork();
  refreshWebhooks();
  try {
    const [snapshots, sandboxes] = await Promise.all([api("GET", "/v1/snapshots"), api("GET", "/v1/sandboxes")]);
    lists = { ...lists, snapshots, sandboxes };
    render();
    refreshUsage();  // the tree does not wait for the figures, nor fail with them
  } catch (err) {
    say(err.message, true);
  }
}

async function refreshUsage() {
  if (!token) return;
  try {
    const usage = await api("GET", "/v1/sandboxes/metrics");
    lists.usage = new Map(usage.map((m) => [m.sandbox_id, m]));
    render();
  } catch {
    // the figures are extras: the tree stays as it is, the next refresh tries again
  }
}

const bytes = (n) => (n >= MIB ? `${(n / MIB).toFixed(1)} MiB` : n >= 1024 ? `${Math.round(n / 1024)} KiB` : `${n} B`);

async function showNetwork(id) {
  watched = id;
  $("network").hidden = false;
  await refreshNetwork();
}

async function refreshNetwork() {
  if (!token || !watched) return;
  const id = watched;
  const path = `/v1/sandboxes/${encodeURIComponent(id)}`;
  try {
    const [policy, page, secrets] = await Promise.all([
      api("GET", `${path}/network`), api("GET", `${path}/egress?limit=1000`), api("GET", "/v1/secrets")]);
    if (id !== watched) return;
    $("network-title").textContent = `Network of ${id}`;
    const list = (xs, none) => (xs.length ? xs.join(", ") : none);
    $("network-policy").replaceChildren(
      el("div", {}, `allow out: ${list(policy.allow_out, "every public destination")}`),
      el("div", {}, `deny out: ${list(policy.deny_out, "–")}`),
      el("div", {}, `rules: ${list(Object.keys(policy.rules), "–")}`),
      el("div", { class: "meta" }, policy.proxied ? "enforced by name by the egress proxy" : "not proxied: by address only"),
      el("button", { class: "danger", onclick: () => act(`cut off ${id}`, () => api("PATCH", `${path}/network`, { deny_out: ["*"], rules: policy.rules })) }, "cut off"),
      el("button", { onclick: () => act(`open ${id}`, () => api("PATCH", `${path}/network`, { rules: policy.rules })) }, "open to the internet"),
      el("div", { class: "meta" }, `secrets it can use: ${list(secrets.map((s) => `${s.name} (${s.hosts.join(", ")})`), "none")}`));
    const rows = page.records.slice(-50).reverse().map((r) => el("tr", { class: `egress-${r.verdict}` },
      el("td", {}, age(r.time)), el("td", {}, r.verdict), el("td", {}, r.kind),
      el("td", {}, `${r.host ?? r.address}:${r.port}`),
      el("td", {}, r.method ? `${r.method} ${r.path}` : ""), el("td", {}, r.secrets.join(", ")),
      el("td", {}, `${bytes(r.bytes_out)} / ${bytes(r.bytes_in)}`), el("td", {}, r.reason ?? "")));
    $("egress-rows").replaceChildren(...rows);
  } catch (err) {
    say(`network of ${id}: ${err.message}`, true);
  }
}

function delivery(d) {
  const when = d.status === "pending" && d.next_attempt_unix
    ? `next try in ${duration(d.next_attempt_unix - Date.now() / 1000)}`
    : `${age(d.ended_at_unix ?? d.created_at_unix)} ago`;
  const answer = d.last_status ? `HTTP ${d.last_status}` : d.last_error ?? "";
  const latency = d.last_latency_ms !== null && d.last_latency_ms !== undefined ? `${Math.round(d.last_latency_ms)} ms` : "";
  return el("li", { class: `delivery-${d.status}` },
    [d.event, d.status, `${d.attempts} attempt${d.attempts === 1 ? "" : "s"}`, answer, latency, when].filter(Boolean).join(" · "));
}

async function refreshWebhooks() {
  if (!token) return;
  try {
    const hooks = await api("GET", "/v1/webhooks");
    const latest = await Promise.all(hooks.map((h) => api("GET", `/v1/webhooks/${encodeURIComponent(h.id)}/deliveries?limit=5`)));
    $("webhook-list").replaceChildren(...hooks.map((h, i) => {
      const path = `/v1/webhooks/${encodeURIComponent(h.id)}`;
      return el("li", { "data-webhook": h.id },
        el("span", { class: "id" }, h.id), " ", el("span", { class: "url" }, h.url),
        el("span", { class: "meta" }, ` ${h.events.join(", ")} · ${h.pending} pending`),
        el("button", { onclick: () => act(`test ${h.id}`, () => api("POST", `${path}/test`)) }, "test"),
        el("button", { class: "danger", onclick: () => act(`remove ${h.id}`, () => api("DELETE", path)) }, "remove"),
        el("ul", { class: "deliveries" }, ...latest[i].map(delivery)));
    }));
    clearTimeout(pendingHooks);  // no event says a delivery went out: look again soon
    if (latest.some((ds) => ds.some((d) => d.status === "pending"))) pendingHooks = setTimeout(refreshWebhooks, 2000);
  } catch (err) {
    say(`webhooks: ${err.message}`, true);
  }
}

function soon() {  // a burst of events: one refresh
  clearTimeout(pending);
  pending = setTimeout(refresh, 150);
}

async function follow() {
  while (token) {
    try {
      const resp = await fetch("/v1/events", { headers: { Authorization: `Bearer ${token}`, Accept: "text/event-stream" } });
      if (!resp.ok) throw new Error(`events: ${resp.status}`);
      const reader = resp.body.pipeThrough(new TextDecoderStream()).getReader();
      let buffer = "";
      for (;;) {
        const { value, done } = await reader.read();
        if (done || !token) break;
        buffer += value;
        let end;
        while ((end = buffer.indexOf("\n\n")) >= 0) {
          const block = buffer.slice(0, end);
          buffer = buffer.slice(end + 2);
          const lines = block.split("\n");
          if (!lines.some((line) => line.startsWith("data:"))) continue;
          if (lines.includes("event: egress")) {  // the panel's, never the whole tree's
            clearTimeout(pendingNet);
            pendingNet = setTimeout(refreshNetwork, 300);
          } else {
            soon();
          }
        }
      }
    } catch {
      // the stream broke (a daemon restart): connect again below
    }
    await new Promise((resolve) => setTimeout(resolve, 2000));
    soon();
  }
}

$("login").addEventListener("submit", async (event) => {
  event.preventDefault();
  token = $("token").value.trim();
  $("token").value = "";
  try {
    await api("GET", "/v1/snapshots");
  } catch (err) {
    token = null;
    say(`cannot connect: ${err.message}`, true);
    return;
  }
  $("login").hidden = true;
  $("console").hidden = false;
  say("connected");
  await refresh();
  follow();
  timers = [setInterval(refresh, 30_000), setInterval(render, 5_000), setInterval(refreshUsage, 10_000)];
});

$("webhook-form").addEventListener("submit", async (event) => {
  event.preventDefault();
  const url = $("webhook-url").value.trim();
  const events = $("webhook-events").value.split(/[\s,]+/).filter(Boolean);
  if (!url) return;
  await act(`add webhook ${url}`, async () => {
    const made = await api("POST", "/v1/webhooks", { url, events: events.length ? events : ["*"] });
    $("webhook-url").value = "";
    $("webhook-events").value = "";
    const shown = $("webhook-secret");
    shown.hidden = !made.secret;  // one of the caller's own is never shown back
    shown.textContent = made.secret ? `${made.id}'s secret (shown this once: keep it for your receiver): ${made.secret}` : "";
  });
});

$("exec-form").addEventListener("submit", async (event) => {
  event.preventDefault();
  const id = $("exec-sandbox").value;
  const command = $("exec-command").value;
  if (!id || !command) return;
  $("exec-output").textContent = "running…";
  try {
    const r = await api("POST", `/v1/sandboxes/${encodeURIComponent(id)}/exec`, { args: ["/bin/sh", "-c", command], timeout_secs: 60 });
    $("exec-output").textContent = `${r.stdout}${r.stderr}\n[exit ${r.exit_code}]`;
  } catch (err) {
    $("exec-output").textContent = err.message;
  }
});

window.addEventListener("pagehide", () => { token = null; timers.forEach(clearInterval); });

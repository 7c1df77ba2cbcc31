/**
 * forkd TypeScript SDK: a client of the forkd daemon's HTTP API (docs/API.md).
 *
 * Only the platform's `fetch` is used (Node 20+, Deno, Bun, browsers): no runtime
 * dependencies. `Client` maps one method to each route; `Sandbox` and `Snapshot`
 * are the objects most code wants.
 *
 *     const snap = await Snapshot.create("py", { warmup: "x = 41" });
 *     const sb = await Sandbox.create("py");
 *     console.log((await sb.commands.run("uname -r")).stdout);
 *     console.log((await sb.eval("x + 1")).result);            // '42'
 *     const branch = await sb.branch();                        // pause, snapshot, resume
 *     const kids = await branch.fork(3);
 *     await sb.kill();
 *
 *     // A template from a container image, its service started before the snapshot:
 *     const pg = await Snapshot.create("pg", { image: "registry.example.com/team/postgres:16", start: true, ready_port: 5432 });
 */

import type {
  JSONObject,
  ClientOptions,
  SandboxInfo,
  SecretInfo,
  SnapshotInfo,
  ImageInfo,
  SnapshotCreateOptions,
  SpawnOptions,
  ImportOptions,
  LoadOptions,
  CommandResult,
  EvalResult,
  OutputEvent,
  TreeNode,
  ExecOptions,
  ProcessOptions,
  ExploreStep,
  ExploreOptions,
  ExploreResult,
  DiffResult,
  DiffOptions,
  WebhookDelivery,
  WebhookInfo,
} from "./types.js";
import { base64Bytes, readSSE } from "./sse.js";

export type * from "./types.js";

/** Every failure: the daemon's answer (`status`, its `error` text) or, with status 0, no answer. */
export class ForkdError extends Error {
  constructor(
    readonly status: number,
    message: string,
    readonly body?: unknown,
  ) {
    super(message);
    this.name = "ForkdError";
  }
}

/** The daemon could not be reached, or did not answer in time (status 0). */
export class ForkdConnectionError extends ForkdError {
  constructor(message: string, readonly cause?: unknown) {
    super(0, message);
    this.name = "ForkdConnectionError";
  }
}

interface RequestOptions {
  body?: unknown;
  raw?: BodyInit;
  contentType?: string;
  query?: Record<string, string | number | boolean | undefined | null>;
  timeoutMs?: number;
  accept?: string;
}

const env = (name: string): string | undefined =>
  (globalThis as any).process?.env?.[name] || undefined;

const q = (segment: string): string => encodeURIComponent(segment);

function dropUndefined(obj: JSONObject): JSONObject {
  return Object.fromEntries(Object.entries(obj).filter(([, v]) => v !== undefined && v !== null));
}

/** The daemon, one method per route of its HTTP API. */
export class Client {
  readonly baseUrl: string;
  readonly timeoutMs: number;
  #token: string | undefined;
  #fetch: typeof fetch;

  constructor(options: ClientOptions = {}) {
    const url = options.baseUrl ?? env("FORKD_URL") ?? "http://127.0.0.1:8889";
    this.baseUrl = (url.includes("://") ? url : `http://${url}`).replace(/\/+$/, "");
    this.timeoutMs = options.timeoutMs ?? 120_000;
    this.#token = options.token ?? env("FORKD_TOKEN");
    this.#fetch = options.fetch ?? globalThis.fetch.bind(globalThis);
  }

  /** One request; a ForkdError unless the answer is 2xx. */
  async request(method: string, path: string, opts: RequestOptions = {}): Promise<Response> {
    const url = new URL(this.baseUrl + path);
    for (const [k, v] of Object.entries(opts.query ?? {})) {
      if (v !== undefined && v !== null) url.searchParams.set(k, String(v));
    }
    const headers: Record<string, string> = { Accept: opts.accept ?? "application/json" };
    if (this.#token) headers.Authorization = `Bearer ${this.#token}`;
    let body: BodyInit | undefined = opts.raw;
    if (opts.body !== undefined) {
      body = JSON.stringify(opts.body);
      headers["Content-Type"] = "application/json";
    } else if (opts.raw !== undefined) {
      headers["Content-Type"] = opts.contentType ?? "application/octet-stream";
    }
    let resp: Response;
    try {
      resp = await this.#fetch(url, {
        method, headers, body, signal: AbortSignal.timeout(opts.timeoutMs ?? this.timeoutMs),
      });
    } catch (err) {
      const timedOut = (err as Error)?.name === "TimeoutError";
      throw new ForkdConnectionError(
        timedOut
          ? `no answer from the forkd daemon at ${this.baseUrl} in time (${method} ${path})`
          : `the forkd daemon is not reachable at ${this.baseUrl} (${(err as Error)?.message ?? err})`,
        err,
      );
    }
    if (!resp.ok) {
      const text = await resp.text();
      let parsed: unknown = text;
      try { parsed = JSON.parse(text); } catch { /* not JSON: keep the text */ }
      const message = (parsed as JSONObject)?.error ?? (text || resp.statusText);
      throw new ForkdError(resp.status, `HTTP ${resp.status}: ${message}`, parsed);
    }
    return resp;
  }

  async json<T = any>(method: string, path: string, opts: RequestOptions = {}): Promise<T> {
    const resp = await this.request(method, path, opts);
    if (resp.status === 204) return undefined as T;
    const text = await resp.text();
    if (!text) return undefined as T;
    try {
      return JSON.parse(text) as T;
    } catch {
      throw new ForkdError(resp.status, `the daemon answered ${method} ${path} with something that is not JSON`, text);
    }
  }

  #sb(id: string): string {
    return `/v1/sandboxes/${q(id)}`;
  }

  // -- discovery, snapshots ---------------------------------------------------

  health(): Promise<JSONObject> { return this.json("GET", "/healthz"); }
  version(): Promise<JSONObject> { return this.json("GET", "/version"); }

  listSnapshots(): Promise<SnapshotInfo[]> { return this.json("GET", "/v1/snapshots"); }
  snapshot(tag: string): Promise<SnapshotInfo> { return this.json("GET", `/v1/snapshots/${q(tag)}`); }
  snapshotInfo(tag: string): Promise<SnapshotInfo> { return this.json("GET", `/v1/snapshots/${q(tag)}/info`); }

  /** Boot a template VM (from `opts.image`, a built image or a container image), warm it, snapshot it. */
  createSnapshot(tag: string, opts: SnapshotCreateOptions = {}): Promise<SnapshotInfo> {
    const readyCmd = typeof opts.ready_cmd === "string" ? ["/bin/sh", "-c", opts.ready_cmd] : opts.ready_cmd;
    const body = dropUndefined({ tag, ...opts, ready_cmd: readyCmd });
    return this.json("POST", "/v1/snapshots", { body, timeoutMs: Math.max(this.timeoutMs, 1_800_000) });
  }

  async deleteSnapshot(tag: string, opts: { cascade?: boolean; force?: boolean } = {}): Promise<void> {
    const query = { cascade: opts.cascade ? "true" : undefined, force: opts.force ? "true" : undefined };
    await this.request("DELETE", `/v1/snapshots/${q(tag)}`, { query });
  }

  /** Flatten a diff snapshot in place; with `to`, into a new full snapshot of that tag (the source kept). */
  compactSnapshot(tag: string, opts: { to?: string } = {}): Promise<SnapshotInfo> {
    const body = opts.to === undefined ? undefined : { to: opts.to };
    return this.json("POST", `/v1/snapshots/${q(tag)}/compact`, { body, timeoutMs: Math.max(this.timeoutMs, 600_000) });
  }

  // -- workspaces (the original forkd's) ---------------------------------------

  listWorkspaces(): Promise<JSONObject[]> { return this.json("GET", "/v1/workspaces"); }
  createWorkspace(name: string, snapshotTag: string, opts: { per_child_netns?: boolean; memory_limit_mib?: number } = {}): Promise<JSONObject> {
    return this.json("POST", "/v1/workspaces", { body: dropUndefined({ name, snapshot_tag: snapshotTag, ...opts }) });
  }
  getWorkspace(name: string): Promise<JSONObject> { return this.json("GET", `/v1/workspaces/${q(name)}`); }
  async deleteWorkspace(name: string): Promise<void> { await this.request("DELETE", `/v1/workspaces/${q(name)}`); }
  suspendWorkspace(name: string): Promise<JSONObject> {
    return this.json("POST", `/v1/workspaces/${q(name)}/suspend`, { body: {}, timeoutMs: Math.max(this.timeoutMs, 600_000) });
  }
  resumeWorkspace(name: string): Promise<JSONObject> {
    return this.json("POST", `/v1/workspaces/${q(name)}/resume`, { body: {}, timeoutMs: Math.max(this.timeoutMs, 600_000) });
  }

  // -- images -----------------------------------------------------------------

  /**
   * Import a container image: a registry reference (`host[:port]/repo:tag`, `...@sha256:...`),
   * `docker-daemon:IMAGE`, `docker-archive:PATH`, `oci-archive:PATH[:tag]` or `oci:DIR[:tag]`
   * (paths on the daemon's host). Its info, with `bytes_fetched` and `bytes_reused`. With
   * `onProgress`, the import is streamed and each step reported as it happens.
   */
  async importImage(ref: string, opts: ImportOptions = {}): Promise<ImageInfo> {
    const body = dropUndefined({ ref, token: opts.token });
    const timeoutMs = Math.max(this.timeoutMs, 3_600_000);
    if (!opts.onProgress) return this.json("POST", "/v1/images", { body, timeoutMs });
    const resp = await this.request("POST", "/v1/images", { body, timeoutMs, accept: "text/event-stream" });
    return this.#imageEvents(resp, opts.onProgress);
  }

  /**
   * Send an image archive (`docker save`, `podman save`, an OCI archive) and import it, as
   * `docker load` does. In Node, `await fs.openAsBlob(path)` sends a file without reading it
   * into memory. `opts.tag` picks the image among several and names it: `createSnapshot(t,
   * { image: tag })` finds it afterwards. Steps go to `opts.onProgress` once the archive has arrived.
   */
  async loadImage(archive: Blob | Uint8Array, opts: LoadOptions = {}): Promise<ImageInfo> {
    const resp = await this.request("POST", "/v1/images/load", {
      raw: archive as BodyInit, contentType: "application/x-tar", query: { tag: opts.tag },
      timeoutMs: Math.max(this.timeoutMs, 3_600_000), accept: "text/event-stream",
    });
    return this.#imageEvents(resp, opts.onProgress ?? (() => {}));
  }

  async #imageEvents(resp: Response, onProgress: (message: string) => void): Promise<ImageInfo> {
    for await (const sse of readSSE(resp)) {
      const data = JSON.parse(sse.data);
      if (sse.event === "progress") onProgress(String(data.message ?? ""));
      else if (sse.event === "image") return data as ImageInfo;
      else if (sse.event === "error") throw new ForkdError(Number(data.status ?? 500), `HTTP ${data.status ?? 500}: ${data.error}`, data);
    }
    throw new ForkdConnectionError(`the forkd daemon at ${this.baseUrl} ended the import unanswered`);
  }

  /** Recipe and container images: sizes, shared layers, who uses each. */
  listImages(): Promise<ImageInfo[]> { return this.json("GET", "/v1/images"); }
  imageInfo(name: string): Promise<ImageInfo> { return this.json("GET", `/v1/images/${q(name)}`); }

  /** Delete an image (409 while a snapshot or sandbox uses it), freeing layers no other image needs. */
  async deleteImage(name: string): Promise<void> { await this.request("DELETE", `/v1/images/${q(name)}`); }

  // -- secrets ----------------------------------------------------------------

  /** A credential the daemon's egress proxy puts into requests bound for `hosts` in place
   * of `${secrets.NAME}`; the guest holds only the placeholder. The answer never has the value. */
  createSecret(name: string, value: string, hosts: string[]): Promise<SecretInfo> {
    return this.json("POST", "/v1/secrets", { body: { name, value, hosts } });
  }
  listSecrets(): Promise<SecretInfo[]> { return this.json("GET", "/v1/secrets"); }
  secretInfo(name: string): Promise<SecretInfo> { return this.json("GET", `/v1/secrets/${q(name)}`); }
  /** Rotate the value and/or replace the hosts; the next request uses them. */
  updateSecret(name: string, change: { value?: string; hosts?: string[] }): Promise<SecretInfo> {
    return this.json("PUT", `/v1/secrets/${q(name)}`, { body: change });
  }
  /** 409 while running sandboxes' network rules name it, unless `force`. */
  async deleteSecret(name: string, opts: { force?: boolean } = {}): Promise<void> {
    await this.request("DELETE", `/v1/secrets/${q(name)}`, { query: opts.force ? { force: "true" } : undefined });
  }

  // -- webhooks ---------------------------------------------------------------

  /** The daemon's `events` (`sandbox.killed`, ..., or `*`) POSTed to `url` from now on, signed as
   * Standard Webhooks sign them; without `secret` the daemon makes one, in this answer only. */
  createWebhook(url: string, opts: { events?: string[]; secret?: string; description?: string } = {}): Promise<WebhookInfo> {
    return this.json("POST", "/v1/webhooks", { body: dropUndefined({ url, ...opts }) });
  }
  listWebhooks(): Promise<WebhookInfo[]> { return this.json("GET", "/v1/webhooks"); }
  webhookInfo(id: string): Promise<WebhookInfo> { return this.json("GET", `/v1/webhooks/${q(id)}`); }
  async deleteWebhook(id: string): Promise<void> { await this.request("DELETE", `/v1/webhooks/${q(id)}`); }
  /** Its latest deliveries, newest first. */
  webhookDeliveries(id: string, limit = 100): Promise<WebhookDelivery[]> {
    return this.json("GET", `/v1/webhooks/${q(id)}/deliveries`, { query: { limit: String(limit) } });
  }
  /** A `webhook.test` message to that webhook. */
  testWebhook(id: string): Promise<{ msg_id: string }> { return this.json("POST", `/v1/webhooks/${q(id)}/test`); }

  // -- sandboxes --------------------------------------------------------------

  spawnSandboxes(snapshotTag: string, opts: SpawnOptions = {}): Promise<SandboxInfo[]> {
    const body = dropUndefined({ snapshot_tag: snapshotTag, n: 1, ...opts });
    return this.json("POST", "/v1/sandboxes", { body, timeoutMs: this.timeoutMs + 2_000 * (body.n as number) });
  }

  listSandboxes(opts: { state?: string; snapshot?: string } = {}): Promise<SandboxInfo[]> {
    return this.json("GET", "/v1/sandboxes", { query: opts });
  }

  getSandbox(id: string): Promise<SandboxInfo> { return this.json("GET", this.#sb(id)); }
  /** Whether reclaim may hibernate it (`evictable`) and a request wakes it (`auto_resume`); left out: kept. */
  updateSandbox(id: string, opts: { evictable?: boolean; auto_resume?: boolean }): Promise<SandboxInfo> {
    return this.json("PATCH", this.#sb(id), { body: dropUndefined(opts) });
  }
  /** What the sandbox uses now (`GET /v1/sandboxes/:id/metrics`); wakes nothing. */
  /** What a sandbox may reach now: allow_out, deny_out, rules, and whether the daemon's egress proxy enforces them. */
  sandboxNetwork(id: string): Promise<JSONObject> { return this.json("GET", `${this.#sb(id)}/network`); }

  /** Replace what a sandbox may reach (E2B's `network` shape); open connections it denies are closed. */
  updateSandboxNetwork(id: string, network: { allow_out?: string[]; deny_out?: string[]; rules?: JSONObject }): Promise<JSONObject> {
    return this.json("PATCH", `${this.#sb(id)}/network`, { body: network });
  }

  /** What a sandbox reached and was refused through the egress proxy, oldest first. */
  sandboxEgress(id: string, opts: { after?: number; limit?: number } = {}): Promise<JSONObject> {
    return this.json("GET", `${this.#sb(id)}/egress`, { query: { after: opts.after ?? 0, limit: opts.limit ?? 100 } });
  }

  sandboxMetrics(id: string): Promise<JSONObject> { return this.json("GET", `${this.#sb(id)}/metrics`); }
  /** Every sandbox's figures (`GET /v1/sandboxes/metrics`), or those of `sandboxIds`. */
  listSandboxMetrics(sandboxIds?: string[]): Promise<JSONObject[]> {
    return this.json("GET", "/v1/sandboxes/metrics", { query: sandboxIds ? { sandbox_ids: sandboxIds.join(",") } : {} });
  }
  /** Its stop hook runs first, unless `force`. */
  async killSandbox(id: string, opts: { force?: boolean } = {}): Promise<void> {
    await this.request("DELETE", this.#sb(id), { query: { force: opts.force ? "true" : undefined } });
  }

  pauseSandbox(id: string, opts: { hibernate?: boolean } = {}): Promise<SandboxInfo> {
    return this.json("POST", `${this.#sb(id)}/pause`, { body: opts.hibernate ? { hibernate: true } : {} });
  }

  resumeSandbox(id: string, opts: { timeout_s?: number } = {}): Promise<SandboxInfo> {
    return this.json("POST", `${this.#sb(id)}/resume`, { body: dropUndefined(opts) });
  }

  setSandboxTimeout(id: string, timeoutS: number | null, idleTimeoutS?: number | null): Promise<SandboxInfo> {
    const body: JSONObject = { timeout_s: timeoutS };
    if (idleTimeoutS !== undefined) body.idle_timeout_s = idleTimeoutS;
    return this.json("POST", `${this.#sb(id)}/timeout`, { body });
  }

  /** `diff: true` is the original forkd's form of mode diff; `measure_diff` a full branch reporting what a diff would store. */
  branchSandbox(id: string, opts: { tag?: string; mode?: "full" | "diff" | "live"; wait?: boolean; metadata?: Record<string, string>; diff?: boolean; measure_diff?: boolean } = {}): Promise<SnapshotInfo> {
    const body = dropUndefined({ tag: opts.tag, mode: opts.mode, metadata: opts.metadata });
    if (opts.diff) body.diff = true;
    if (opts.measure_diff) body.measure_diff = true;
    if (opts.wait === false) body.wait = false;
    return this.json("POST", `${this.#sb(id)}/branch`, { body });
  }

  /**
   * Branch the sandbox once, fork a child per variant, run each variant and then `opts.score`
   * in its child, keep the best `opts.keep` and kill the rest (docs/API.md, "Explore"). A step
   * is a shell command, an argv, `{ exec, env, stdin, cwd, user }` or `{ eval }`.
   */
  exploreSandbox(id: string, variants: ExploreStep[], opts: ExploreOptions = {}): Promise<ExploreResult> {
    const body = dropUndefined({
      variants: variants.map(stepBody), score: opts.score === undefined ? undefined : stepBody(opts.score),
      keep: opts.keep, keep_as: opts.keep_as, minimize: opts.minimize, timeout_secs: opts.timeout_secs,
      seed: opts.seed, tag: opts.tag, metadata: opts.metadata,
    });
    // The variants' deadline, plus the branch, the fork and keeping (not under it): a client
    // that stops waiting cancels the explore and loses what it found.
    const timeoutMs = Math.max(this.timeoutMs, ((opts.timeout_secs ?? 300) + 600 + 30 * (opts.keep ?? 1)) * 1000);
    return this.json("POST", `${this.#sb(id)}/explore`, { body, timeoutMs });
  }

  /** What the sandbox changed under `opts.path`, against its snapshot or `opts.against` (docs/API.md, "Diff"). */
  diffSandbox(id: string, opts: DiffOptions = {}): Promise<DiffResult> {
    return this.json("GET", `${this.#sb(id)}/diff`, { query: { path: opts.path, against: opts.against } });
  }

  /** The same as a unified diff of the changed text files. */
  async diffPatch(id: string, opts: DiffOptions = {}): Promise<string> {
    const resp = await this.request("GET", `${this.#sb(id)}/diff`, { query: { path: opts.path, against: opts.against, format: "patch" }, accept: "text/x-diff" });
    return resp.text();
  }

  /** The added and modified files as a tar archive. */
  async diffTar(id: string, opts: DiffOptions = {}): Promise<Uint8Array> {
    const resp = await this.request("GET", `${this.#sb(id)}/diff`, { query: { path: opts.path, against: opts.against, format: "tar" }, accept: "application/x-tar" });
    return new Uint8Array(await resp.arrayBuffer());
  }

  /** Run `args` and wait; `user`: as this user (name, uid, name:group, uid:gid; default the image's USER, else root). */
  exec(id: string, args: string[], opts: ExecOptions = {}): Promise<JSONObject> {
    const timeout = opts.timeoutSecs ?? 30;
    const body = dropUndefined({ args, timeout_secs: timeout, cwd: opts.cwd, env: opts.env, stdin: opts.stdin, user: opts.user });
    return this.json("POST", `${this.#sb(id)}/exec`, { body, timeoutMs: (timeout + 30) * 1000 });
  }

  eval(id: string, code: string, timeoutS?: number): Promise<JSONObject> {
    const wait = (timeoutS ?? 60) + 30;
    return this.json("POST", `${this.#sb(id)}/eval`, { body: dropUndefined({ code, timeout_s: timeoutS }), timeoutMs: Math.max(this.timeoutMs, wait * 1000) });
  }

  ping(id: string): Promise<JSONObject> { return this.json("POST", `${this.#sb(id)}/ping`); }

  // -- files --------------------------------------------------------------------

  async readFile(id: string, path: string): Promise<Uint8Array> {
    const resp = await this.request("GET", `${this.#sb(id)}/files`, { query: { path }, accept: "application/octet-stream" });
    return new Uint8Array(await resp.arrayBuffer());
  }

  async writeFile(id: string, path: string, data: string | Uint8Array): Promise<void> {
    const bytes = typeof data === "string" ? new TextEncoder().encode(data) : data;
    const raw = new Blob([bytes as Uint8Array<ArrayBuffer>]);
    await this.request("PUT", `${this.#sb(id)}/files`, { query: { path }, raw });
  }

  async listFiles(id: string, path: string): Promise<JSONObject[]> {
    const body = await this.json("GET", `${this.#sb(id)}/files/list`, { query: { path } });
    return Array.isArray(body?.entries) ? body.entries : body;
  }

  async removeFile(id: string, path: string, recursive = false): Promise<void> {
    await this.request("DELETE", `${this.#sb(id)}/files`, { query: { path, recursive: recursive ? "true" : "false" } });
  }

  // -- background processes -----------------------------------------------------

  /** Start `cmd` in the background (a string runs as `/bin/sh -c`); `user` as `exec`'s. */
  startProcess(id: string, cmd: string | string[], opts: ProcessOptions = {}): Promise<JSONObject> {
    return this.json("POST", `${this.#sb(id)}/processes`, { body: dropUndefined({ cmd, stdin: opts.stdin ?? false, env: opts.env, cwd: opts.cwd, timeout_s: opts.timeout_s, user: opts.user }) });
  }

  listProcesses(id: string): Promise<JSONObject[]> { return this.json("GET", `${this.#sb(id)}/processes`); }

  /** A process's output from `offset` as it comes; with `follow` it ends with `exit`. */
  async *processOutput(id: string, pid: number, opts: { offset?: number; follow?: boolean } = {}): AsyncGenerator<OutputEvent> {
    const query = { offset: opts.offset ?? 0, follow: opts.follow === false ? "false" : "true" };
    const resp = await this.request("GET", `${this.#sb(id)}/processes/${pid}/output`, { query, accept: "text/event-stream", timeoutMs: 24 * 3600_000 });
    for await (const sse of readSSE(resp)) {
      const body = JSON.parse(sse.data);
      if (sse.event === "error") throw new ForkdError(Number(body.status ?? 502), String(body.error), body);
      if (sse.event === "exit") { yield { kind: "exit", exitCode: body.exit_code ?? null }; return; }
      if (sse.event === "gap") { yield { kind: "gap", offset: body.from, nextOffset: body.to }; continue; }
      const data = body.encoding === "base64" ? base64Bytes(body.data) : new TextEncoder().encode(body.data);
      yield { kind: sse.event, data, text: new TextDecoder().decode(data), offset: body.offset, nextOffset: body.next_offset };
    }
  }

  /** Lifecycle events (`created`, `branched`, `killed`, ...) as they happen, until `signal` aborts;
   * with `since`, those the daemon still holds after that event id first (0: all it holds). */
  async *events(opts: { types?: string[]; sandboxId?: string; since?: number; signal?: AbortSignal } = {}): AsyncGenerator<JSONObject> {
    const url = new URL(`${this.baseUrl}/v1/events`);
    if (opts.types) url.searchParams.set("type", opts.types.join(","));
    if (opts.sandboxId) url.searchParams.set("sandbox_id", opts.sandboxId);
    if (opts.since !== undefined) url.searchParams.set("since", String(opts.since));
    const headers: Record<string, string> = { Accept: "text/event-stream" };
    if (this.#token) headers.Authorization = `Bearer ${this.#token}`;
    let resp: Response;
    try {
      resp = await this.#fetch(url, { headers, signal: opts.signal });
    } catch (err) {
      if ((err as Error)?.name === "AbortError") return;
      throw new ForkdConnectionError(`the forkd daemon is not reachable at ${this.baseUrl}`, err);
    }
    if (!resp.ok) throw new ForkdError(resp.status, `HTTP ${resp.status}: ${await resp.text()}`);
    try {
      for await (const sse of readSSE(resp)) yield JSON.parse(sse.data);
    } catch (err) {
      if ((err as Error)?.name !== "AbortError") throw err;
    }
  }

  /** Snapshots nested under their parents, with the sandboxes forked from each. */
  async tree(): Promise<TreeNode[]> {
    const [snaps, sandboxes] = await Promise.all([this.listSnapshots(), this.listSandboxes()]);
    const nodes = new Map<string, TreeNode>(snaps.map((s) => [s.tag, {
      tag: s.tag, mode: s.mode ?? "full", status: s.status, branched_from: s.branched_from ?? null,
      pause_ms: s.pause_ms ?? null, sandboxes: [], children: [],
    }]));
    for (const sb of sandboxes) nodes.get(sb.snapshot_tag)?.sandboxes.push({ id: sb.id, state: sb.state });
    const roots: TreeNode[] = [];
    for (const s of snaps) {
      const parent = s.parent_tag ? nodes.get(s.parent_tag) : undefined;
      (parent ? parent.children : roots).push(nodes.get(s.tag)!);
    }
    return roots;
  }
}

function commandResult(raw: JSONObject): CommandResult {
  const exitCode = raw.exit_code ?? (raw.timed_out ? 124 : -1);
  return { stdout: raw.stdout ?? "", stderr: raw.stderr ?? "", exitCode, timedOut: Boolean(raw.timed_out ?? exitCode === 124) };
}

/** One running sandbox. */
export class Sandbox {
  readonly commands: {
    run: (cmd: string | string[], opts?: ExecOptions) => Promise<CommandResult>;
    start: (cmd: string | string[], opts?: ProcessOptions) => Promise<JSONObject>;
    output: (pid: number, opts?: { offset?: number; follow?: boolean }) => AsyncGenerator<OutputEvent>;
    list: () => Promise<JSONObject[]>;
  };
  readonly files: {
    read: (path: string) => Promise<Uint8Array>;
    readText: (path: string) => Promise<string>;
    write: (path: string, data: string | Uint8Array) => Promise<void>;
    list: (path: string) => Promise<JSONObject[]>;
    remove: (path: string, recursive?: boolean) => Promise<void>;
  };

  constructor(readonly client: Client, public info: SandboxInfo) {
    const id = info.id;
    this.commands = {
      run: async (cmd, opts = {}) => commandResult(await client.exec(id, typeof cmd === "string" ? ["/bin/sh", "-c", cmd] : cmd, opts)),
      start: (cmd, opts = {}) => client.startProcess(id, cmd, opts),
      output: (pid, opts = {}) => client.processOutput(id, pid, opts),
      list: () => client.listProcesses(id),
    };
    this.files = {
      read: (path) => client.readFile(id, path),
      readText: async (path) => new TextDecoder().decode(await client.readFile(id, path)),
      write: (path, data) => client.writeFile(id, path, data),
      list: (path) => client.listFiles(id, path),
      remove: (path, recursive = false) => client.removeFile(id, path, recursive),
    };
  }

  /** Fork a sandbox from snapshot `tag` (options as the API's: timeout_s, metadata, ...). */
  static async create(tag: string, opts: JSONObject & { client?: Client } = {}): Promise<Sandbox> {
    const { client = new Client(), ...spawn } = opts;
    const [info] = await client.spawnSandboxes(tag, { ...spawn, n: 1 });
    return new Sandbox(client, info!);
  }

  static async connect(id: string, client: Client = new Client()): Promise<Sandbox> {
    return new Sandbox(client, await client.getSandbox(id));
  }

  get id(): string { return this.info.id; }

  async refresh(): Promise<SandboxInfo> { return (this.info = await this.client.getSandbox(this.id)); }

  /** CPU, memory, disk, network and processes, as E2B's `getMetrics()`. */
  getMetrics(): Promise<JSONObject> { return this.client.sandboxMetrics(this.id); }

  async eval(code: string, timeoutS?: number): Promise<EvalResult> {
    const raw = await this.client.eval(this.id, code, timeoutS);
    return { result: raw.result ?? null, error: raw.error ?? null, stdout: raw.stdout ?? null, stderr: raw.stderr ?? null, exitCode: raw.exit_code ?? 0 };
  }

  async branch(opts: { tag?: string; mode?: "full" | "diff" | "live"; wait?: boolean } = {}): Promise<Snapshot> {
    const info = await this.client.branchSandbox(this.id, opts);
    return new Snapshot(this.client, info);
  }

  /**
   * Try each variant in its own copy of this sandbox, score them, keep the best running
   * (see `Client.exploreSandbox`); this sandbox runs on.
   *
   *     const res = await sb.explore(["patch -p1 < a.diff", "patch -p1 < b.diff"], { score: "pytest -q | grep -c PASSED" });
   *     const winner = await Sandbox.connect(res.results[0].sandbox_id!);
   */
  explore(variants: ExploreStep[], opts: ExploreOptions = {}): Promise<ExploreResult> {
    return this.client.exploreSandbox(this.id, variants, opts);
  }

  /** What this sandbox changed (see `Client.diffSandbox`); `diffPatch`/`diffTar` on the client give a patch or a tar. */
  diff(opts: DiffOptions = {}): Promise<DiffResult> {
    return this.client.diffSandbox(this.id, opts);
  }

  async pause(opts: { hibernate?: boolean } = {}): Promise<SandboxInfo> { return (this.info = await this.client.pauseSandbox(this.id, opts)); }
  async resume(opts: { timeout_s?: number } = {}): Promise<SandboxInfo> { return (this.info = await this.client.resumeSandbox(this.id, opts)); }

  /** Kill it; a sandbox already gone is not an error. */
  async kill(): Promise<void> {
    try {
      await this.client.killSandbox(this.id);
    } catch (err) {
      if (!(err instanceof ForkdError && err.status === 404)) throw err;
    }
  }
}

/** A snapshot: a template or a branch, to fork sandboxes from. */
export class Snapshot {
  constructor(readonly client: Client, public info: SnapshotInfo) {}

  /**
   * Build a template snapshot: `image` a built image's name or a container image reference
   * (imported first); `start` runs its Entrypoint+Cmd until `ready_port` listens or `ready_cmd`
   * exits 0, so every fork starts with the service running.
   */
  static async create(tag: string, opts: SnapshotCreateOptions & { client?: Client } = {}): Promise<Snapshot> {
    const { client = new Client(), ...body } = opts;
    return new Snapshot(client, await client.createSnapshot(tag, body));
  }

  static async get(tag: string, client: Client = new Client()): Promise<Snapshot> {
    return new Snapshot(client, await client.snapshot(tag));
  }

  get tag(): string { return this.info.tag; }
  get pauseMs(): number | null { return this.info.pause_ms ?? null; }
  get branchedFrom(): string | null { return this.info.branched_from ?? null; }

  async fork(n = 1, opts: JSONObject = {}): Promise<Sandbox[]> {
    const infos = await this.client.spawnSandboxes(this.tag, { ...opts, n });
    return infos.map((info) => new Sandbox(this.client, info));
  }

  /** Poll until no longer `pending` (a branch with wait: false). */
  async wait(timeoutMs = 600_000, intervalMs = 200): Promise<Snapshot> {
    const deadline = Date.now() + timeoutMs;
    for (;;) {
      this.info = await this.client.snapshot(this.tag);
      if (this.info.status !== "writing" && this.info.status !== "pending") return this;
      if (Date.now() > deadline) throw new ForkdError(0, `snapshot ${this.tag} still pending after ${timeoutMs} ms`);
      await new Promise((r) => setTimeout(r, intervalMs));
    }
  }

  async refresh(): Promise<SnapshotInfo> { return (this.info = await this.client.snapshotInfo(this.tag)); }
  async delete(opts: { cascade?: boolean; force?: boolean } = {}): Promise<void> { await this.client.deleteSnapshot(this.tag, opts); }
}

function stepBody(step: ExploreStep): JSONObject {
  if (typeof step === "string") return { exec: ["sh", "-c", step] };
  if (Array.isArray(step)) return { exec: step };
  return { ...step } as JSONObject;
}

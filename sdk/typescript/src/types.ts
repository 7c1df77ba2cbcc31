/** The shapes the forkd daemon's HTTP API sends and takes (docs/API.md), as TypeScript types. */

export type JSONValue = null | boolean | number | string | JSONValue[] | { [key: string]: JSONValue };
export type JSONObject = { [key: string]: any };

export interface ClientOptions {
  /** `http://host:port`; default `$FORKD_URL`, else `http://127.0.0.1:8889`. */
  baseUrl?: string;
  /** Bearer token; default `$FORKD_TOKEN`. */
  token?: string;
  /** Milliseconds to wait for an answer (exec, eval and builds wait longer). */
  timeoutMs?: number;
  /** A fetch to use instead of the global one (tests, proxies). */
  fetch?: typeof fetch;
}

export interface SandboxInfo extends JSONObject {
  id: string;
  snapshot_tag: string;
  state: "starting" | "running" | "paused" | "hibernated" | "dead";
  has_branched: boolean;
  branch_count: number;
  /** Its random seed, when forked with one (child i of a fork with `seed` gets seed + i). */
  seed?: number | null;
}

export interface SnapshotInfo extends JSONObject {
  tag: string;
  status: "ready" | "writing" | "pending" | "failed" | "broken";
  branched_from?: string | null;
  pause_ms?: number | null;
  parent_tag?: string | null;
  mode?: "full" | "diff";
  /** A diff (or measure_diff) branch's answer, as the original forkd's. */
  diff_ms?: number;
  diff_physical_bytes?: number;
  diff_logical_bytes?: number;
}

/** What a container image sets, as Docker honours it. */
export interface ImageConfig {
  env: string[];
  working_dir: string;
  user: string;
  entrypoint: string[];
  cmd: string[];
  exposed_ports: string[];
  labels: Record<string, string>;
}

/** A secret as the daemon describes it: never its value. */
export interface SecretInfo extends JSONObject {
  name: string;
  hosts: string[];
  created_at_unix: number;
  updated_at_unix: number;
  last_used_unix: number | null;
}

/** A webhook: an endpoint the daemon's events are delivered to, signed (Standard Webhooks). */
export interface WebhookInfo extends JSONObject {
  id: string;
  url: string;
  events: string[];
  description: string;
  created_at_unix: number;
  pending: number;
  /** Only in the answer to its creation, and only when the daemon made it. */
  secret?: string;
}

/** One delivery of a message to a webhook: its attempts and the last answer. */
export interface WebhookDelivery extends JSONObject {
  msg_id: string;
  event: string;
  status: "pending" | "delivered" | "failed";
  attempts: number;
  created_at_unix: number;
  next_attempt_unix: number | null;
  last_status: number | null;
  last_error: string | null;
  last_latency_ms: number | null;
  ended_at_unix: number | null;
}

/** A guest image: built from a recipe, or imported from a container image. */
export interface ImageInfo extends JSONObject {
  name: string;
  key: string;
  kind: "recipe" | "container";
  references?: string[];
  id?: string | null;
  digest?: string | null;
  layers?: number | null;
  size_bytes: number;
  layer_bytes?: number | null;
  shared_layer_bytes?: number | null;
  created_at_unix: number;
  config?: ImageConfig | null;
  used_by?: string[];
  /** An import's answer only: bytes it fetched, bytes the cache had, seconds it took. */
  bytes_fetched?: number | null;
  bytes_reused?: number | null;
  import_secs?: number | null;
}

/** `POST /v1/snapshots` fields (as the API names them); others are sent as given. */
export interface SnapshotCreateOptions extends JSONObject {
  /** A built image's name (`listImages`; default `python`), or a container image reference, imported first. */
  image?: string;
  memory_mib?: number;
  vcpus?: number;
  setup?: string[];
  warmup?: string;
  /** Run the image's Entrypoint+Cmd in the background before the snapshot. */
  start?: boolean;
  /** With `start`: wait until this guest TCP port listens. */
  ready_port?: number;
  /** With `start`: wait until this exits 0 (an argv, or a string run as `/bin/sh -c`). */
  ready_cmd?: string | string[];
  ready_timeout_secs?: number;
  metadata?: Record<string, string>;
  /** A command the guest runs before the daemon stops any of the template's forks (docs/API.md, "Stop hooks"). */
  on_stop?: string;
  /** Seconds the stop hook may take before it is cut off (default 10). */
  on_stop_timeout_s?: number;
}

/** `POST /v1/sandboxes` fields (as the API names them); others are sent as given. */
export interface SpawnOptions extends JSONObject {
  n?: number;
  metadata?: Record<string, string>;
  timeout_s?: number;
  idle_timeout_s?: number;
  memory_limit_mib?: number;
  /** This fork's stop hook, over the template's (docs/API.md, "Stop hooks"). */
  on_stop?: string;
  on_stop_timeout_s?: number;
}

export interface ImportOptions {
  /** A bearer token for the registry (default: the daemon's docker config.json). */
  token?: string;
  /** Called with each step of the import as the daemon takes it (the import is then streamed). */
  onProgress?: (message: string) => void;
}

export interface LoadOptions {
  /** NAME[:TAG]: picks the image among several in the archive, and names it. */
  tag?: string;
  /** Called with each step of the import once the archive has arrived. */
  onProgress?: (message: string) => void;
}

export interface CommandResult {
  stdout: string;
  stderr: string;
  exitCode: number;
  timedOut: boolean;
}

export interface EvalResult {
  result: string | null;
  error: string | null;
  stdout: string | null;
  stderr: string | null;
  exitCode: number;
}

/** One piece of a process's output stream (`stdout`, `stderr`, `pty`, `gap`, `exit`). */
export interface OutputEvent {
  kind: string;
  data?: Uint8Array;
  text?: string;
  offset?: number;
  nextOffset?: number;
  exitCode?: number | null;
}

export interface TreeNode {
  tag: string;
  mode: string;
  status: string;
  branched_from: string | null;
  pause_ms: number | null;
  sandboxes: { id: string; state: string }[];
  children: TreeNode[];
}

export interface ExecOptions {
  timeoutSecs?: number;
  cwd?: string;
  env?: Record<string, string>;
  stdin?: string;
  /** Run as this user: name, uid, name:group or uid:gid; default the image's USER, else root. */
  user?: string;
}

export interface ProcessOptions {
  env?: Record<string, string>;
  cwd?: string;
  stdin?: boolean;
  timeout_s?: number;
  /** As `ExecOptions.user`. */
  user?: string;
}

/** A step of an explore: a shell command, an argv, or the wire form. */
export type ExploreStep =
  | string
  | string[]
  | { exec: string[]; env?: Record<string, string>; stdin?: string; cwd?: string; user?: string }
  | { eval: string };

export interface ExploreOptions {
  /** Run in each child after its variant: prints a number on its last line (an eval returns one). */
  score?: ExploreStep;
  /** Children kept, best first (default 1). */
  keep?: number;
  /** "snapshots": each kept child is branched, then killed. */
  keep_as?: "sandboxes" | "snapshots";
  minimize?: boolean;
  /** The whole explore (default 300). */
  timeout_secs?: number;
  /** Variant i's child gets seed + i. */
  seed?: number;
  /** The branch's tag, which names the explore. */
  tag?: string;
  metadata?: Record<string, string>;
}

export interface ExploreVariant {
  index: number;
  sandbox_id: string | null;
  /** null when its step or score failed: see `error`. */
  score: number | null;
  exit_code: number | null;
  stdout_tail: string;
  /** The end of what its score step printed (an eval's result). */
  score_tail: string;
  error: string | null;
  kept: boolean;
  snapshot_tag: string | null;
  duration_ms: number;
}

export interface ExploreResult {
  branch: string;
  pause_ms: number | null;
  fork_ms: number;
  duration_ms: number;
  branch_kept: boolean;
  /** Best first; failed variants last. */
  results: ExploreVariant[];
}

export interface FileChange {
  path: string;
  change: "added" | "modified" | "removed";
  kind: "file" | "dir" | "symlink" | "other";
  size: number;
  mode: number;
}

export interface DiffResult {
  sandbox_id: string;
  against: string;
  against_kind: "snapshot" | "sandbox";
  path: string;
  /** Sorted by path. */
  changes: FileChange[];
  truncated: boolean;
  duration_ms: number;
}

export interface DiffOptions {
  /** The directory to compare (default "/"). */
  path?: string;
  /** A snapshot tag or sandbox id of the same image (default: the sandbox's snapshot). */
  against?: string;
}

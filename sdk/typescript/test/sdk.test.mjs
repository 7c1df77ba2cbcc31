// The TypeScript SDK against a real forkd daemon (node's own test runner).
// FORKD_URL, FORKD_TOKEN and FORKD_TEMPLATE (a snapshot whose warm-up set x = 41)
// name it; FORKD_IMAGE_REF a container image it can import (FORKD_IMAGE_USER its
// USER, FORKD_IMAGE_PORT the port its command listens on, FORKD_IMAGE_MISSING a
// reference of the same kind that is not there, FORKD_IMAGE_ARCHIVE the same image as
// an archive file on this host); tests/integration/test_typescript_sdk.py
// runs this file with them.
import { test } from "node:test";
import assert from "node:assert/strict";

import { Client, ForkdConnectionError, ForkdError, Sandbox, Snapshot } from "../dist/index.js";

const template = process.env.FORKD_TEMPLATE;
const image = {
  ref: process.env.FORKD_IMAGE_REF,
  user: process.env.FORKD_IMAGE_USER,
  port: Number(process.env.FORKD_IMAGE_PORT),
  missing: process.env.FORKD_IMAGE_MISSING,
  archive: process.env.FORKD_IMAGE_ARCHIVE,
};
const client = new Client();

async function output(sb, pid) {
  let text = "";
  for await (const ev of sb.commands.output(pid)) if (ev.kind === "stdout") text += ev.text;
  return text;
}

test("needs a daemon", { skip: template ? false : "FORKD_URL/FORKD_TOKEN/FORKD_TEMPLATE not set" }, async (t) => {
  const made = [];
  t.after(async () => {
    for (const sb of made) await sb.kill();
  });

  await t.test("snapshots", async () => {
    const snap = await Snapshot.get(template, client);
    assert.equal(snap.tag, template);
    assert.equal(snap.info.status, "ready");
    assert.equal(snap.pauseMs, null);
    const listed = await client.listSnapshots();
    assert.ok(listed.some((s) => s.tag === template));
  });

  await t.test("fork, exec, eval, files", async () => {
    const kids = await (await Snapshot.get(template, client)).fork(2);
    made.push(...kids);
    assert.equal(kids.length, 2);
    assert.notEqual(kids[0].id, kids[1].id);
    const sb = kids[0];
    const run = await sb.commands.run("echo hello; exit 3");
    assert.equal(run.stdout, "hello\n");
    assert.equal(run.exitCode, 3);
    assert.equal((await sb.commands.run("id -un", { user: "nobody" })).stdout, "nobody\n");
    const ev = await sb.eval("x + 1");
    assert.equal(ev.result, "42");
    assert.equal(ev.error, null);
    await sb.files.write("/tmp/ts.txt", "from typescript");
    assert.equal(await sb.files.readText("/tmp/ts.txt"), "from typescript");
    const bytes = Uint8Array.from([0, 255, 1, 254]);
    await sb.files.write("/tmp/bin", bytes);
    assert.deepEqual(await sb.files.read("/tmp/bin"), bytes);
    const names = (await sb.files.list("/tmp")).map((e) => e.name);
    assert.ok(names.includes("ts.txt") && names.includes("bin"));
    await sb.files.remove("/tmp/bin");
    assert.ok(!(await sb.files.list("/tmp")).some((e) => e.name === "bin"));
  });

  await t.test("branch, fork the branch, tree", async () => {
    const sb = await Sandbox.create(template, { client });
    made.push(sb);
    await sb.eval("marker = 'before branch'");
    const branch = await sb.branch({ tag: "ts-branch" });
    assert.equal(branch.branchedFrom, sb.id);
    assert.equal(typeof branch.pauseMs, "number");
    assert.ok(Number.isInteger(branch.pauseMs));
    await sb.eval("marker = 'after branch'");
    const [grandchild] = await branch.fork(1);
    made.push(grandchild);
    assert.equal((await grandchild.eval("marker")).result, "'before branch'");
    assert.equal((await sb.refresh()).branch_count, 1);
    const tree = await client.tree();
    const root = tree.find((n) => n.tag === template);
    const node = root.children.find((n) => n.tag === "ts-branch");
    assert.ok(node.sandboxes.some((s) => s.id === grandchild.id));
    assert.deepEqual((await client.snapshotInfo("ts-branch")).ancestors, [template]);
    await grandchild.kill();
    await branch.delete();
  });

  await t.test("explore: variants scored, the best kept, seeds given", async () => {
    const sb = await Sandbox.create(template, { client });
    made.push(sb);
    const res = await sb.explore([{ eval: "y = 2" }, { eval: "y = 7" }, "exit 4"], {
      score: { eval: "x + y" }, keep: 1, seed: 100,
    });
    assert.deepEqual(res.results.map((r) => r.index), [1, 0, 2]);
    assert.deepEqual(res.results.map((r) => r.score), [48, 43, null]);
    assert.match(res.results[2].error, /step exited 4/);
    assert.ok(res.results[0].kept && !res.results[1].kept);
    const winner = await Sandbox.connect(res.results[0].sandbox_id, client);
    made.push(winner);
    assert.equal(winner.info.seed, 101);
    assert.equal(winner.info.metadata["forkd.score"], "48");
    await winner.files.write("/tmp/ts-diff.txt", "from the winner\n");
    const diff = await winner.diff({ path: "/tmp" });
    assert.ok(diff.changes.some((c) => c.path === "/tmp/ts-diff.txt" && c.change === "added"), JSON.stringify(diff));
    assert.match(await client.diffPatch(winner.id, { path: "/tmp" }), /\+\+\+ b\/ts-diff\.txt\n(.|\n)*\+from the winner/);
    assert.equal((await sb.refresh()).state, "running");
    const metrics = await sb.getMetrics();
    assert.equal(metrics.sandbox_id, sb.id);
    assert.ok(metrics.cpu.seconds > 0 && metrics.memory.host_private_bytes > 0, JSON.stringify(metrics));
    assert.ok((await client.listSandboxMetrics([sb.id])).every((m) => m.sandbox_id === sb.id));
  });

  await t.test("a stop hook given at the fork runs at a kill, not at a forced one", async () => {
    const [hooked, forced] = await client.spawnSandboxes(template, {
      n: 2, on_stop: "echo stopping > /dev/null", on_stop_timeout_s: 5,
    });
    await client.killSandbox(hooked.id);
    await client.killSandbox(forced.id, { force: true });
    const said = [];
    for await (const e of client.events({ types: ["stop_hook", "killed"], since: 0 })) {
      if (e.sandbox_id === hooked.id || e.sandbox_id === forced.id) said.push([e.type, e.sandbox_id]);
      if (said.length === 3) break;
    }
    // the hook ran for the one killed plainly, before its kill; the forced one had none
    assert.deepEqual(said, [["stop_hook", hooked.id], ["killed", hooked.id], ["killed", forced.id]]);
  });

  await t.test("the original forkd's forms: diff: true, compact to a new tag, workspaces", async () => {
    const [sb] = await client.spawnSandboxes(template, { n: 1 });
    const diff = await client.branchSandbox(sb.id, { tag: "ts-diff", diff: true });
    assert.equal(diff.mode, "diff");
    assert.ok(Number.isInteger(diff.diff_physical_bytes) && diff.diff_logical_bytes > 0);
    const flat = await client.compactSnapshot("ts-diff", { to: "ts-flat" });
    assert.equal(flat.tag, "ts-flat");
    assert.equal(flat.mode, "full");
    assert.equal((await client.snapshot("ts-diff")).mode, "diff"); // the source is kept
    await client.killSandbox(sb.id);
    await client.deleteSnapshot("ts-flat");
    await client.deleteSnapshot("ts-diff");

    const ws = await client.createWorkspace("ts-ws", template);
    assert.equal(ws.status, "running");
    assert.equal((await client.suspendWorkspace("ts-ws")).status, "suspended");
    const back = await client.resumeWorkspace("ts-ws");
    assert.equal(back.live_sandbox_id, ws.live_sandbox_id);
    assert.ok((await client.listWorkspaces()).some((w) => w.name === "ts-ws"));
    await client.deleteWorkspace("ts-ws");
    await assert.rejects(client.getWorkspace("ts-ws"), (err) => err.status === 404);
  });

  await t.test("background process and its output stream", async () => {
    const sb = made[0];
    const proc = await sb.commands.start("for i in 1 2 3; do echo line $i; done; exit 7");
    let text = "";
    let exitCode;
    for await (const ev of sb.commands.output(proc.pid)) {
      if (ev.kind === "stdout") text += ev.text;
      if (ev.kind === "exit") exitCode = ev.exitCode;
    }
    assert.equal(text, "line 1\nline 2\nline 3\n");
    assert.equal(exitCode, 7);
  });

  await t.test("events", async () => {
    const abort = new AbortController();
    const seen = [];
    const reading = (async () => {
      for await (const ev of client.events({ types: ["created"], signal: abort.signal })) {
        seen.push(ev);
        if (seen.length === 1) abort.abort();
      }
    })();
    await new Promise((r) => setTimeout(r, 300)); // the stream is open before the fork
    const sb = await Sandbox.create(template, { client });
    made.push(sb);
    await reading;
    assert.equal(seen[0].type, "created");
    assert.equal(seen[0].sandbox_id, sb.id);
  });

  await t.test("secrets: write-only, rotated, deleted", async () => {
    const name = `ts_${process.pid}`;
    const made = await client.createSecret(name, "ts-secret-value-123", ["api.ts.test"]);
    assert.deepEqual(made.hosts, ["api.ts.test"]);
    assert.equal(made.value, undefined);
    assert.ok((await client.listSecrets()).some((s) => s.name === name));
    const moved = await client.updateSecret(name, { hosts: ["*.ts.test"] });
    assert.deepEqual(moved.hosts, ["*.ts.test"]);
    await client.deleteSecret(name);
    await assert.rejects(client.secretInfo(name), (err) => err instanceof ForkdError && err.status === 404);
  });

  await t.test("webhooks: refused where the operator did not allow, listed, deleted", async () => {
    await assert.rejects(
      client.createWebhook("http://10.9.9.9/hooks"),
      (err) => err instanceof ForkdError && err.status === 400 && /not a public address/.test(err.message),
    );
    assert.ok(Array.isArray(await client.listWebhooks()));
    await assert.rejects(client.webhookInfo("wh_0000000000000000"), (err) => err instanceof ForkdError && err.status === 404);
    await assert.rejects(client.webhookDeliveries("wh_0000000000000000"), (err) => err instanceof ForkdError && err.status === 404);
  });

  await t.test("a sandbox's network: replaced at runtime, its egress listed", async () => {
    const [sb] = await client.spawnSandboxes(template, { network: { allow_out: ["api.ts.test"] } });
    assert.deepEqual((await client.sandboxNetwork(sb.id)).allow_out, ["api.ts.test"]);
    const cut = await client.updateSandboxNetwork(sb.id, { deny_out: ["*"] });
    assert.deepEqual(cut.deny_out, ["*"]);
    assert.ok(Array.isArray((await client.sandboxEgress(sb.id)).records));
    await client.killSandbox(sb.id);
  });

  await t.test("typed errors", async () => {
    await assert.rejects(client.getSandbox("sb-nope-0000"), (err) => err instanceof ForkdError && err.status === 404);
    await assert.rejects(client.spawnSandboxes(template, { n: 0 }), (err) => err instanceof ForkdError && err.status === 400);
    const nowhere = new Client({ baseUrl: "http://127.0.0.1:9", timeoutMs: 2000 });
    await assert.rejects(nowhere.health(), (err) => err instanceof ForkdConnectionError && err.status === 0);
  });

  await t.test("kill", async () => {
    const sb = made.pop();
    await sb.kill();
    await assert.rejects(client.getSandbox(sb.id), (err) => err.status === 404);
    await sb.kill(); // again: no error
  });
});

test("container images", { skip: image.ref ? false : "FORKD_IMAGE_REF not set" }, async (t) => {
  const made = [];
  t.after(async () => {
    for (const sb of made) await sb.kill();
    await client.deleteSnapshot("ts-image").catch(() => {});
  });

  await t.test("import with progress, again from the cache, list, info", async () => {
    const steps = [];
    const first = await client.importImage(image.ref, { onProgress: (m) => steps.push(m) });
    assert.equal(first.kind, "container");
    assert.ok(steps.length > 0 && steps.every((m) => typeof m === "string" && m.length > 0));
    const again = await client.importImage(image.ref);
    assert.equal(again.name, first.name);
    assert.ok(again.bytes_reused > 0 && again.bytes_fetched < again.bytes_reused);
    assert.ok((await client.listImages()).some((i) => i.name === first.name));
    const info = await client.imageInfo(first.name);
    assert.ok(info.references.includes(image.ref));
    assert.equal(info.config.user, image.user);
  });

  await t.test("an archive sent from this host (docker load), found by its tag", async () => {
    const { openAsBlob } = await import("node:fs");
    const steps = [];
    const loaded = await client.loadImage(await openAsBlob(image.archive), {
      tag: "ts/busybox:1", onProgress: (m) => steps.push(m),
    });
    assert.equal(loaded.name, (await client.importImage(image.ref)).name); // the same image
    assert.ok(loaded.references.includes("loaded:ts/busybox:1"));
    assert.ok(steps.some((m) => m.startsWith("received the archive")), steps.join("\n"));
    await assert.rejects(client.loadImage(new Uint8Array(4096)), (err) => err instanceof ForkdError && err.status === 400);
  });

  await t.test("a template from the image, its service started, commands as its user", async () => {
    const snap = await Snapshot.create("ts-image", { client, image: image.ref, start: true, ready_port: image.port });
    assert.equal(snap.info.status, "ready");
    assert.equal(snap.info.image, (await client.importImage(image.ref)).name);
    const [kid] = await snap.fork(1);
    made.push(kid);
    assert.equal((await kid.commands.run("id -un")).stdout, `${image.user}\n`);
    assert.equal((await kid.commands.run(["id", "-un"], { user: "root" })).stdout, "root\n");
    const proc = await kid.commands.start("id -un", { user: "root" });
    assert.equal(await output(kid, proc.pid), "root\n");
    const mine = await kid.commands.start("id -un");
    assert.equal(await output(kid, mine.pid), `${image.user}\n`);
  });

  await t.test("errors", async () => {
    await assert.rejects(client.importImage(image.missing), (err) => err instanceof ForkdError && err.status === 404);
    await assert.rejects(
      client.importImage(image.missing, { onProgress: () => {} }),
      (err) => err instanceof ForkdError && err.status === 404,
    );
    await assert.rejects(
      Snapshot.create("ts-never", { client, image: image.ref, ready_port: image.port }),
      (err) => err instanceof ForkdError && err.status === 400,
    );
    await assert.rejects(client.imageInfo("oci-000000000000"), (err) => err.status === 404);
  });
});

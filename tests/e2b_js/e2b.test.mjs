// E2B's own npm SDKs (e2b, @e2b/code-interpreter; pinned in package.json) against a
// forkd daemon's E2B port, unchanged: tests/integration/test_e2b_js.py runs this with
// E2B_API_URL, E2B_SANDBOX_URL and E2B_API_KEY pointed at the suite's daemon, and
// E2B_TEMPLATE naming a template snapshot of it.
import assert from 'node:assert/strict'
import { mkdtempSync, writeFileSync } from 'node:fs'
import { tmpdir } from 'node:os'
import { join } from 'node:path'
import { test } from 'node:test'

import { Sandbox as CodeSandbox } from '@e2b/code-interpreter'
import { CommandExitError, Sandbox, Template, Volume } from 'e2b'

const template = process.env.E2B_TEMPLATE
const timeoutMs = 300_000

async function until(check, ms = 20_000) {
  const deadline = Date.now() + ms
  while (!check() && Date.now() < deadline) {
    await new Promise((resolve) => setTimeout(resolve, 100))
  }
  return check()
}

test('commands, files and a streamed watch in a real guest', async () => {
  const sbx = await Sandbox.create(template, { timeoutMs })
  try {
    const ran = await sbx.commands.run('echo hello from node && echo err >&2')
    assert.equal(ran.stdout, 'hello from node\n')
    assert.equal(ran.stderr, 'err\n')
    await assert.rejects(sbx.commands.run('exit 3'), (err) => {
      assert.ok(err instanceof CommandExitError)
      assert.equal(err.exitCode, 3)
      return true
    })
    const lines = []
    await sbx.commands.run('for i in 1 2 3; do echo $i; done', {
      onStdout: (data) => lines.push(data),
    })
    assert.equal(lines.join(''), '1\n2\n3\n')

    await sbx.files.makeDir('/work/js')
    await sbx.files.write('/work/js/a.txt', 'typed in node')
    assert.equal(await sbx.files.read('/work/js/a.txt'), 'typed in node')
    const listed = await sbx.files.list('/work/js')
    assert.deepEqual(listed.map((e) => e.name), ['a.txt'])
    assert.equal((await sbx.files.getInfo('/work/js/a.txt')).size, 13)

    const events = []
    const watch = await sbx.files.watchDir('/work/js', (e) => events.push(e))
    await sbx.commands.run('touch /work/js/b.txt')
    const seen = await until(() => events.some((e) => e.name === 'b.txt' && e.type === 'create'))
    await watch.stop()
    assert.ok(seen, JSON.stringify(events))
  } finally {
    await sbx.kill()
  }
  assert.equal(await Sandbox.kill(sbx.sandboxId), false) // gone
})

test('the code interpreter keeps its names between executions', async () => {
  const sbx = await CodeSandbox.create(template, { timeoutMs })
  try {
    const first = await sbx.runCode('x = 41\nprint("hi")\nx + 1')
    assert.equal(first.text, '42')
    assert.deepEqual(first.logs.stdout, ['hi\n'])
    const failed = await sbx.runCode('undefined_name')
    assert.equal(failed.error.name, 'NameError')
  } finally {
    await sbx.kill()
  }
})

test('a template built with the SDK is a template its sandboxes start from', async () => {
  const context = mkdtempSync(join(tmpdir(), 'e2b-js-build-'))
  writeFileSync(join(context, 'note.txt'), 'copied from node\n')
  const built = Template({ fileContextPath: context })
    .fromTemplate(template)
    .copy('note.txt', '/srv/js/')
    .setEnvs({ FROM_JS: 'yes' })
    .runCmd('cat /srv/js/note.txt > /srv/js/ran.txt')
  const logs = []
  await Template.build(built, 'e2b-js-built', { onBuildLogs: (entry) => logs.push(entry.message) })
  try {
    assert.ok(logs.some((line) => line.includes('is ready')), logs.join('\n'))
    const sbx = await Sandbox.create('e2b-js-built', { timeoutMs })
    try {
      const ran = await sbx.commands.run('cat /srv/js/ran.txt; echo $FROM_JS')
      assert.equal(ran.stdout, 'copied from node\nyes\n')
    } finally {
      await sbx.kill()
    }
  } finally {
    const res = await fetch(`${process.env.E2B_API_URL}/templates/e2b-js-built`, {
      method: 'DELETE',
      headers: { 'X-API-Key': process.env.E2B_API_KEY },
    })
    assert.equal(res.status, 204)
  }
})

test('a volume two sandboxes share, and its content API', async () => {
  const vol = await Volume.create('js-shared')
  const a = await Sandbox.create(template, { timeoutMs, volumeMounts: { '/mnt/js': vol } })
  const b = await Sandbox.create(template, { timeoutMs, volumeMounts: { '/data': 'js-shared' } })
  try {
    await a.commands.run('echo from-node-a > /mnt/js/a.txt')
    assert.equal(await b.files.read('/data/a.txt'), 'from-node-a\n')
    assert.equal(await vol.readFile('/a.txt'), 'from-node-a\n') // no sandbox needed
    await vol.writeFile('/from-api.txt', 'written through the API')
    assert.equal((await a.commands.run('cat /mnt/js/from-api.txt')).stdout, 'written through the API')
    const names = (await vol.list('/')).map((e) => e.name)
    assert.deepEqual(names, ['a.txt', 'from-api.txt'])
  } finally {
    await a.kill()
    await b.kill()
  }
  assert.equal(await Volume.destroy(vol.volumeId), true)
})

'use strict'
// forkd's JavaScript eval worker: an E2B code interpreter context in the image's own
// Node.js, one persistent global scope (declarations and values stay between evals),
// as forkd_eval_proc.py drives a Python worker. The agent starts it as
// `node forkd-js-worker.js`, as the image's user, in the context's directory.
//
// One JSON request a line on stdin, one answer a line on stdout (written with
// fs.writeSync, never through process.stdout, which user code's output goes to):
//
//   agent -> worker  {"id": 3, "op": "eval", "code": "x + 1", "timeout_s": 60}
//                    {"id": 4, "op": "reseed", "seed": 1234}
//   worker -> agent  {"id": 3, "ok": true, "result": {result, error, stdout, ...}}
//
// An eval is interrupted by SIGINT; Math.random is reseeded on SIGUSR2 (the agent sends
// both). Output is kept up to
// MAX_OUTPUT characters a stream; the agent checks every answer again. Only Node's
// own modules are used.

const fs = require('node:fs')
const path = require('node:path')
const readline = require('node:readline')
const util = require('node:util')
const vm = require('node:vm')
const { Console } = require('node:console')
const { Writable } = require('node:stream')
const { createRequire } = require('node:module')

const MAX_OUTPUT = 1024 * 1024 // characters of stdout, of stderr, of the result
const TRUNCATED = '... [truncated]'

function say(message) {
  fs.writeSync(1, JSON.stringify(message) + '\n')
}

let out = null // the running eval's output, while one runs
let interrupted = null // rejects an awaited promise when SIGINT comes

function capture(stream, text) {
  if (out === null) {
    fs.writeSync(2, text) // between evals: the worker's stderr, never the protocol
    return
  }
  const room = MAX_OUTPUT - out[stream].length
  if (text.length > room) {
    out[stream] += text.slice(0, Math.max(0, room))
    out.cut[stream] = true
  } else {
    out[stream] += text
  }
}

const sink = (stream) =>
  new Writable({
    decodeStrings: false,
    write(chunk, _encoding, done) {
      capture(stream, String(chunk))
      done()
    },
  })
process.stdout.write = (chunk) => (capture('stdout', String(chunk)), true)
process.stderr.write = (chunk) => (capture('stderr', String(chunk)), true)
process.on('SIGINT', () => {
  if (interrupted !== null) interrupted(Object.assign(new Error('interrupted'), { name: 'KeyboardInterrupt' }))
})

// Math.random in the context: sfc32, seeded from the kernel's RNG, and seeded again on
// SIGUSR2, which the agent sends when the VM was restored from a snapshot (a fork, a
// wake): V8's own generator cannot be reseeded, and sibling forks would draw the same.
let rng = new Uint32Array(4)
function reseed() {
  const fd = fs.openSync('/dev/urandom', 'r')
  try {
    fs.readSync(fd, rng, 0, rng.byteLength, null)
  } finally {
    fs.closeSync(fd)
  }
}
function random() {
  const [a, b, c, d] = rng
  const t = (((a + b) >>> 0) + d) >>> 0
  rng = Uint32Array.of(b ^ (b >>> 9), (c + (c << 3)) >>> 0, ((c << 21) | (c >>> 11)) + t, (d + 1) >>> 0)
  return t / 4294967296
}
reseed()
process.on('SIGUSR2', reseed)

const here = process.cwd()
const context = vm.createContext({
  console: new Console({ stdout: sink('stdout'), stderr: sink('stderr') }),
  process,
  require: createRequire(path.join(here, '[eval]')),
  module: { exports: {} },
  __dirname: here,
  __filename: path.join(here, '[eval]'),
  Buffer,
  URL,
  URLSearchParams,
  TextEncoder,
  TextDecoder,
  AbortController,
  fetch: globalThis.fetch,
  structuredClone: globalThis.structuredClone,
  queueMicrotask,
  setTimeout,
  clearTimeout,
  setInterval,
  clearInterval,
  setImmediate,
  clearImmediate,
})

vm.runInContext('Math', context).random = random

function describe(err) {
  // A traceback as forkd's Python answers one: frames, then "Name: message" last.
  if (err !== null && typeof err === 'object' && typeof err.stack === 'string') {
    const name = String(err.name || 'Error')
    const message = String(err.message ?? '')
    const frames = err.stack.split('\n').filter((line) => /^\s+at /.test(line))
    return ['Traceback (most recent call last):', ...frames, `${name}: ${message}`].join('\n')
  }
  return `Error: Uncaught ${util.inspect(err, { depth: 2 })}`
}

function awaited(value, ms) {
  return new Promise((resolve, reject) => {
    const timer = setTimeout(() => reject(Object.assign(new Error(`timed out after ${ms} ms`), { name: 'EvalTimeout', timedOut: true })), ms)
    interrupted = reject
    Promise.resolve(value).then(resolve, reject).finally(() => {
      clearTimeout(timer)
      interrupted = null
    })
  })
}

function script(code) {
  try {
    return new vm.Script(code, { filename: 'cell.js' })
  } catch (err) {
    if (!(err instanceof SyntaxError) || !/await/.test(String(err.message))) throw err
    // Top-level await: the cell runs as an async function (its declarations are its own).
    return new vm.Script(`(async () => {\n${code}\n})()`, { filename: 'cell.js' })
  }
}

async function evaluate(code, timeoutS) {
  const ms = Math.max(1, Math.floor(Number(timeoutS) * 1000) || 60000)
  out = { stdout: '', stderr: '', cut: { stdout: false, stderr: false } }
  let result = null
  let error = null
  let timedOut = false
  try {
    let value = script(code).runInContext(context, { timeout: ms, breakOnSigint: true })
    if (value !== null && typeof value === 'object' && typeof value.then === 'function') {
      value = await awaited(value, ms)
    }
    if (value !== undefined) {
      result = util.inspect(value, { depth: 4, maxArrayLength: 200, breakLength: 100 })
      if (result.length > MAX_OUTPUT) result = result.slice(0, MAX_OUTPUT) + TRUNCATED
    }
  } catch (err) {
    if (err && (err.code === 'ERR_SCRIPT_EXECUTION_TIMEOUT' || err.timedOut)) timedOut = true
    if (err && err.code === 'ERR_SCRIPT_EXECUTION_INTERRUPTED') err.name = 'KeyboardInterrupt'
    error = describe(err)
  }
  const answer = {
    result,
    error,
    stdout: out.stdout,
    stderr: out.stderr,
    stdout_truncated: out.cut.stdout,
    stderr_truncated: out.cut.stderr,
    display: [],
    display_truncated: false,
    timed_out: timedOut,
  }
  out = null
  return answer
}

async function handle(line) {
  let req
  try {
    req = JSON.parse(line)
  } catch {
    return
  }
  if (req === null || typeof req !== 'object' || !Number.isInteger(req.id)) return
  try {
    if (req.op === 'eval') {
      if (typeof req.code !== 'string') throw new Error("'code' must be a string")
      say({ id: req.id, ok: true, result: await evaluate(req.code, req.timeout_s) })
    } else if (req.op === 'reseed' || req.op === 'interrupt') {
      say({ id: req.id, ok: true, result: req.op === 'reseed' ? {} : { interrupted: false } })
    } else {
      throw new Error(`unknown op: ${JSON.stringify(req.op)}`)
    }
  } catch (err) {
    say({ id: req.id, ok: false, error: String((err && err.message) || err) })
  }
}

let queue = Promise.resolve()
const lines = readline.createInterface({ input: process.stdin, crlfDelay: Infinity })
lines.on('line', (line) => {
  queue = queue.then(() => handle(line))
})
lines.on('close', () => queue.then(() => process.exit(0)))
say({ ready: true, python: process.version, executable: process.execPath })

// Starts `tessera serve` as a child process for the JS end-to-end tests and stops it with SIGTERM.
// Paths come from env TESSERA_CLI / TESSERA_SERVE_MODEL (set by ctest) or argv[2] / argv[3].
import { spawn } from 'node:child_process';
import fs from 'node:fs';

export function servePaths() {
  const cli = process.env.TESSERA_CLI || process.argv[2];
  const model = process.env.TESSERA_SERVE_MODEL || process.argv[3];
  if (!cli || !model) {
    throw new Error('set TESSERA_CLI (the tessera binary) and TESSERA_SERVE_MODEL (a model dir), ' +
                    'or pass them as arguments: node TEST.mjs TESSERA_CLI MODEL_DIR');
  }
  if (!fs.existsSync(cli)) throw new Error(`TESSERA_CLI: ${cli} does not exist (build tessera_cli)`);
  if (!fs.existsSync(model)) throw new Error(`TESSERA_SERVE_MODEL: ${model} does not exist (run make_serve_model)`);
  return { cli, model };
}

const live = new Set();
process.on('exit', () => { for (const p of live) p.kill('SIGKILL'); });  // never leave a server behind
for (const sig of ['SIGINT', 'SIGTERM']) process.once(sig, () => process.exit(128 + (sig === 'SIGINT' ? 2 : 15)));

// Resolves once the server prints "listening on http://HOST:PORT" on stderr. `model`: another
// model directory than TESSERA_SERVE_MODEL.
export async function startServer(extraArgs = [], { timeoutMs = 30000, model: modelDir } = {}) {
  const paths = servePaths();
  const cli = paths.cli, model = modelDir || paths.model;
  const args = ['serve', '--model', model, '--port', '0', ...extraArgs];
  const proc = spawn(cli, args, { stdio: ['ignore', 'pipe', 'pipe'] });
  live.add(proc);
  const log = [];
  let exited = null;
  const exitPromise = new Promise((resolve) => {
    proc.on('exit', (code, signal) => { exited = { code, signal }; live.delete(proc); resolve(exited); });
  });
  proc.stdout.on('data', (d) => log.push(String(d)));
  const url = await new Promise((resolve, reject) => {
    let pending = '';
    const timer = setTimeout(() => reject(new Error(
      `tessera serve printed no "listening on" line within ${timeoutMs} ms:\n${log.join('')}`)), timeoutMs);
    proc.stderr.on('data', (d) => {
      const text = String(d);
      log.push(text);
      pending += text;
      const m = /listening on (http:\/\/[^\s]+)/.exec(pending);
      if (m) { clearTimeout(timer); resolve(m[1].replace(/\/$/, '')); }
    });
    proc.on('error', (e) => { clearTimeout(timer); reject(e); });
    exitPromise.then((e) => { clearTimeout(timer); reject(new Error(
      `tessera serve exited (code ${e.code}, signal ${e.signal}) before listening: ${cli} ${args.join(' ')}\n${log.join('')}`)); });
  });
  const port = Number(new URL(url).port);
  return {
    url, port, proc, log: () => log.join(''),
    // SIGTERM, then the exit code (or throws if it has not exited within timeoutMs).
    async stop(stopTimeoutMs = 30000) {
      if (!exited) proc.kill('SIGTERM');
      let timer;
      const result = await Promise.race([exitPromise, new Promise((resolve) => {
        timer = setTimeout(() => resolve(null), stopTimeoutMs);
      })]);
      clearTimeout(timer);
      if (!result) {
        proc.kill('SIGKILL');
        throw new Error(`tessera serve did not exit within ${stopTimeoutMs} ms of SIGTERM`);
      }
      return result;
    },
    kill() { if (!exited) proc.kill('SIGKILL'); },
  };
}

// Polls fn() until it returns a truthy value; throws with `what` after timeoutMs.
export async function waitFor(fn, what, timeoutMs = 10000, intervalMs = 100) {
  const deadline = Date.now() + timeoutMs;
  let last;
  for (;;) {
    try { last = await fn(); if (last) return last; } catch (e) { last = e; }
    if (Date.now() > deadline) throw new Error(`timed out waiting for ${what} (last: ${last})`);
    await new Promise((r) => setTimeout(r, intervalMs));
  }
}

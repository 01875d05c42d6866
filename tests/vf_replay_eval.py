"""Run by path in the verifiers venv (tests/test_verifiers.py): verifiers' own eval (`run_eval`,
what `vf-eval` runs) of an environment against a replay endpoint that answers each chat call
with the reply the policy gave that same conversation in asyncrl's run, read from the episodes
asyncrl's runner saved (`task.traces_dir`). Prints JSON: each episode's reward by task idx, and
the calls the replay could not answer (none, when the conversations are the same).

    python vf_replay_eval.py SPEC_JSON   # {traces_dir, env, python_path, env_args, idx, out}
"""

from __future__ import annotations

import asyncio
import json
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any, ClassVar


def replies(traces_dir: Path) -> dict[str, tuple[str, str]]:
    """(reply, finish reason) by the conversation before it, over every saved episode."""
    table = {}
    for path in traces_dir.rglob("traces.jsonl"):
        for line in path.read_text().splitlines():
            for trace in json.loads(line)["traces"]:
                nodes = trace["nodes"]
                finish = {c["node"]: c.get("finish_reason") or "stop" for c in trace["calls"]}
                for i, node in enumerate(nodes):
                    if node.get("sampled"):
                        table[key(_path(nodes, i))] = (node["message"]["content"], finish[i])
    return table


def _path(nodes: list[dict[str, Any]], i: int) -> list[dict[str, Any]]:
    """The messages before node i, root first."""
    before = []
    parent = nodes[i].get("parent")
    while parent is not None:
        before.append(nodes[parent]["message"])
        parent = nodes[parent].get("parent")
    return before[::-1]


def key(messages: list[dict[str, Any]]) -> str:
    return json.dumps([[m["role"], m.get("content") or ""] for m in messages])


class Replay(BaseHTTPRequestHandler):
    table: ClassVar[dict[str, tuple[str, str]]] = {}
    misses: ClassVar[list[str]] = []

    def do_POST(self) -> None:
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        found = self.table.get(key(body["messages"]))
        if found is None:
            self.misses.append(key(body["messages"]))
            self.send_error(500, "no such conversation in asyncrl's episodes")
            return
        text, finish = found
        head = {"id": "r", "created": 0, "model": body.get("model", "replay")}
        if not body.get("stream"):
            choice = {"index": 0, "message": {"role": "assistant", "content": text}}
            self._send(
                "application/json",
                json.dumps(
                    {
                        **head,
                        "object": "chat.completion",
                        "choices": [{**choice, "finish_reason": finish}],
                        "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2},
                    }
                ),
            )
            return
        chunk = {**head, "object": "chat.completion.chunk"}
        events = [
            {
                **chunk,
                "choices": [
                    {
                        "index": 0,
                        "delta": {"role": "assistant", "content": text},
                        "finish_reason": None,
                    }
                ],
            },
            {**chunk, "choices": [{"index": 0, "delta": {}, "finish_reason": finish}]},
            {
                **chunk,
                "choices": [],
                "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2},
            },
        ]
        self._send(
            "text/event-stream",
            "".join(f"data: {json.dumps(e)}\n\n" for e in events) + "data: [DONE]\n\n",
        )

    def _send(self, kind: str, text: str) -> None:
        data = text.encode()
        self.send_response(200)
        self.send_header("Content-Type", kind)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *args: Any) -> None:
        pass


def main() -> None:
    spec = json.loads(sys.argv[1])
    sys.path[:0] = spec["python_path"]
    import os

    from verifiers.v1.cli.eval.runner import run_eval
    from verifiers.v1.configs.cli.eval import EvalConfig

    Replay.table = replies(Path(spec["traces_dir"]))
    server = ThreadingHTTPServer(("127.0.0.1", 0), Replay)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    os.environ["REPLAY_KEY"] = "replay"
    args = dict(spec["env_args"])
    config = EvalConfig.model_validate(
        {
            "env": {
                **args,
                "taskset": {"id": spec["env"], **args.get("taskset", {})},
                "agent": {"runtime": {"type": "subprocess"}, "harness": {"id": "null"}},
            },
            "client": {
                "base_url": f"http://127.0.0.1:{server.server_address[1]}/v1",
                "api_key_var": "REPLAY_KEY",
            },
            "model": "replay",
            "select": {"include": {"idx": spec["idx"]}},
            "push": False,
            "rich": None,
            "output_dir": spec["out"],
        }
    )
    episodes = asyncio.run(run_eval(config))
    rewards = {str(e.task.data.idx): [t.reward for t in e.traces] for e in episodes}
    print(json.dumps({"rewards": rewards, "ok": [e.ok for e in episodes], "misses": Replay.misses}))


if __name__ == "__main__":
    main()

"""`asyncrl serve`: the builtin torch engine behind SGLang's native and OpenAI's HTTP APIs, a CPU
stand-in for an SGLang server (tests, small models, machines without SGLang).

`server.py` holds the HTTP plumbing and the endpoints (one `ROUTES` table), `native.py` SGLang's
`/generate` (request → jobs, replies, SSE) and `openai_api.py` the `/v1/*` API over the same jobs.
The SGLang engine backend that drives such servers is `asyncrl.sglang`; the only piece shared
with it is the weight-update group formation (`asyncrl.sglang.publisher`), because both ends of
SGLang's collective weight sync must form the group with the same call.
"""

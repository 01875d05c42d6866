"""The HTTP APIs asyncrl answers, as requests and replies, whoever serves them: `native.py`
(SGLang 0.5.23's `/generate`: requests → jobs, outputs, replies, SSE), `openai.py` (OpenAI's
`/v1/models`, `/v1/completions`, `/v1/chat/completions` over the same jobs) and `responses.py`
(OpenAI's `/v1/responses`, a translation of chat). `asyncrl serve` (`asyncrl.serve`) and the
agent gateway (`asyncrl.gateway`) both speak them; how a request is read and answered is
`asyncrl.web`."""

"""An OpenAI-compatible server for the mixture: ``dual-sampling serve``.

Routes: ``POST /v1/completions``, ``POST /v1/chat/completions`` (``stream`` true or false),
``GET /v1/models``, ``GET /health`` (200 only while both engines run), ``GET /metrics``
(Prometheus text) and ``GET /openapi.json``. Requests and responses are vLLM's OpenAI models
extended with the mixture's fields (:mod:`dual_sampling.server.protocol`). Every choice also
carries, under the key ``dual_sampling``, the per-token records of its tokens (α, log π_t,
log π_θ, log q, the token ids) and, on its last chunk, ``log_w_theta`` and any error. The
standard ``logprobs`` report log q, the distribution actually sampled.

The teacher's view comes from extra body fields: ``teacher_prompt`` (completions) or
``teacher_messages`` (chat) replace the teacher's input; ``hint`` is rendered into the
teacher's user message with the template of ``dual-sampling generate``.

Under load: at most ``max_queue`` samples are held at once (a request of ``n`` holds ``n``);
past it a request gets 429 at once. Samples are served first come first served. A client
that disconnects, stops reading for ``send_timeout`` or outlives ``request_timeout`` has its
request aborted on both engines. A dead engine turns ``/health`` red, ends the requests in
flight with an error, makes new ones 503, and ends :func:`~dual_sampling.server.app.serve`
with exit status 1 so that a supervisor restarts it.

Bad input is a 400 (or 401, 404, 408, 413, 415) naming the field; a fault of the server itself
is a logged 500, and a stream that meets one ends with an error event and ``[DONE]``. No
response ever holds a non-finite number.

The modules, each importing only those listed before it:

- ``protocol``: the request and response models;
- ``serve_options``: :class:`~dual_sampling.server.serve_options.ServeOptions`;
- ``wire``: strict JSON parsing and error bodies;
- ``metrics``: Prometheus;
- ``guard``: the ASGI middleware (API key, body size and type, slow readers);
- ``translate``: request → job;
- ``render``: sample → body or stream chunk;
- ``serving``: admission, fan-out, streaming;
- ``app``: the routes and :func:`~dual_sampling.server.app.serve`.
"""

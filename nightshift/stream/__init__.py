"""Scoring a Redis stream with the registered `@champion`: `nightshift score-stream`.

A stream entry has one field, `data`, holding a JSON object. Input: `id` and the model's feature
columns. Output: `id`, `prediction`, `model_version`, `latency_ms`. Dead letter: `id` when known,
`reason`, and the raw `data`.

Modules: `records` (parse an input, build output and dead-letter payloads: pure), `scorer` (the
champion's pyfunc and its input validation), `redis_io` (the connection, the consumer group, the
atomic write-and-acknowledge script), `consumer` (the loop: batches, claims, reconnects, champion
swaps, signals), `announce` (what the deploy step tells consumers), `cli`.
"""

"""The server's query path on a CPU: how a query becomes a vector fast, on the machine it runs on.

`precision` builds an engine (float32, torch int8 over per-row int8 linears `int8_linear`,
packed or padded `packed_bert`, int8 in ONNX Runtime); `choice` times the available engines on
this machine and picks the fastest whose vectors agree with float32; `process` runs the chosen
engine in a child process (out of the server's GIL); `locked` serialises calls into one encoder.
"""

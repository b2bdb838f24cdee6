"""Seed corpora for the fuzzers: valid inputs to mutate from."""
import os
import struct
import sys

out = sys.argv[1]
sched = os.path.join(out, "corpus_schedule_fuzz")
trace = os.path.join(out, "corpus_alloc_trace_fuzz")
os.makedirs(sched, exist_ok=True)
os.makedirs(trace, exist_ok=True)
with open(os.path.join(sched, "csv"), "w") as f:
    f.write("# megatronapp schedule name=s stages=2 microbatches=2 chunks=1\n"
            "stage,type,microbatch,chunk\n0,F,0,0\n0,F,1,0\n1,F,0,0\n1,B,0,0\n1,F,1,0\n"
            "1,B,1,0\n0,B,0,0\n0,B,1,0\n")
with open(os.path.join(sched, "json"), "w") as f:
    f.write('{"name":"s","stages":2,"microbatches":1,"chunks":1,"actions":[[{"type":"F",'
            '"microbatch":0},{"type":"B","microbatch":0}],[{"type":"F","microbatch":0},'
            '{"type":"B","microbatch":0}]]}')


def varint(n):
    b = bytearray()
    while True:
        x = n & 0x7F
        n >>= 7
        b.append(x | (0x80 if n else 0))
        if not n:
            return bytes(b)


ev = [bytes([1]) + varint(0) + varint(4096) + varint(0), bytes([1]) + varint(1) + varint(100)
      + varint(1), bytes([3]) + varint(1) + varint(2), bytes([2]) + varint(0), bytes([4]),
      bytes([2]) + varint(1)]
with open(os.path.join(trace, "t"), "wb") as f:
    f.write(b"MAPPTRC1" + struct.pack("<Q", len(ev)) + b"".join(ev))

"""Layout of the pool's control segment: int64 words, one 64-byte line per flag.

  word  who writes        who reads   meaning
  CMD.. main, before SEQ  workers     the job: command and its integer params
  F_*   main, before SEQ  workers     float params (a float64 view of line 2)
  S_*   main, before OPEN workers     session shape (see hetero.offload.arena)
  ARG*  main, before SEQ  workers     LoRA commands: slot / staging dims
  NAME  main, before OPEN workers     segment name (KV session, adapter or staging), NUL-padded bytes
  NEXT  main (0, before GO) workers   next attention unit to take: each worker atomically
        then workers (fetch-add)      fetch-adds it and computes the unit it got (line 7)
  GO    main (release)    worker w    job number for w (line DONE_LINE + w, word 2);
                                      a new value = a new job. Only the workers a job
                                      uses are woken: the others never see it.
  DONE  worker w (release) main       last job finished by w (same line, word 0)
  ERR   worker w, before DONE main    last job that failed in w (same line, word 1)
"""
import numpy as np

LINE = 8  # int64 words per 64-byte cache line
CMD, LAYER, QLEN, WINDOW, NSPLIT = 8, 9, 10, 11, 12
F_SCALE, F_SOFTCAP = 16, 17                     # float64 words
S_BATCH, S_HQ, S_HKV, S_HDIM, S_CAP, S_LAYERS, S_CODE, S_TMAX = range(24, 32)
S_NSPLIT_MAX = 32
S_RING, S_RING_LAYERS = 35, 36                   # ring rows and ring layers (sliding windows, arena.ring_plan)
ARG0, ARG1 = 33, 34
NAME_WORD, NAME_BYTES = 40, 128                 # lines 5-6
NEXT = 56                                       # line 7, alone: every worker hits it
DONE_LINE = 8


def done_word(rank):
    return (DONE_LINE + rank) * LINE


def err_word(rank):
    return done_word(rank) + 1


def go_word(rank):
    return done_word(rank) + 2


def nbytes(nworkers):
    return (DONE_LINE + nworkers) * LINE * 8


# commands
CMD_PING, CMD_OPEN, CMD_CLOSE, CMD_ATTN, CMD_EXIT = 1, 2, 3, 4, 5
CMD_LORA_OPEN, CMD_ADAPTER_MAP, CMD_ADAPTER_DROP, CMD_LORA = 6, 7, 8, 9


def write_name(words, name):
    raw = name.encode()
    if len(raw) >= NAME_BYTES:
        raise ValueError(f"segment name too long: {name!r}")
    buf = words[NAME_WORD:NAME_WORD + NAME_BYTES // 8].view(np.uint8)
    buf[:] = 0
    buf[:len(raw)] = np.frombuffer(raw, np.uint8)


def read_name(words):
    buf = words[NAME_WORD:NAME_WORD + NAME_BYTES // 8].view(np.uint8)
    return bytes(buf).rstrip(b"\0").decode()

"""Layout of the pool's control segment: int64 words, one 64-byte line per flag.

  word  who writes        who reads   meaning
  CMD.. main, before SEQ  workers     the job: command and its integer params
  F_*   main, before SEQ  workers     float params (a float64 view of line 2)
  PSPLIT main, before SEQ workers    a shared-prefix session's prefix splits this job (word 14)
  NGROUPS main, before SEQ workers   a paged pool's job: its shared-prefix groups (word 15)
  S_*   main, before OPEN workers     session shape (see hetero.offload.arena); S_GROUPS/S_PRIVATE:
                                      shared-prefix groups and private rows (21-22);
                                      S_BLOCKS/S_MAXBLK: a paged pool's blocks, table width (38-39)
  ARG*  main, before SEQ  workers     LoRA commands: slot / staging dims
  POP_* main, before SEQ  workers     CMD_POPULATE: two byte ranges of the session segment
                                      (offset, bytes, offset, bytes), shared by every worker
                                      (words 9-12: attention params, never UNITS, which the
                                      watchdog compares with FIN)
  NAME  main, before OPEN workers     segment name (KV session, adapter or staging), NUL-padded bytes
  TICKET main (before GO), workers   attention units left, tagged with the job number:
         then workers and main         job << 32 | units left (ticket()). Whoever takes a unit
         (compare-and-swap)            (atomics.claim) reads the job's params only after, so a
                                       worker that wakes after its job ended takes nothing (line 7)
  FIN   main (0, before GO) main      attention units finished: each taker fetch-adds it after
        then takers (fetch-add)       writing the unit's partials; main waits for UNITS (line 8)
  GO    main (release)    worker w    job number and command for w: go(seq, cmd) (line DONE_LINE
                                      + w, word 2); a new value = a new job, read in one load.
                                      Only the workers a job uses are woken.
  DONE  worker w (release) main       last job finished by w (same line, word 0); an attention job
                                      ends when FIN = UNITS, whoever did the units
  ERR   worker w, before DONE main    last job that failed in w (same line, word 1)
  BUSY  worker w          main        last attention job w took a unit of (same line, word 3):
                                      names the workers holding units when a job stalls
  AWAKE main            workers     1: idle workers keep spinning, never sleep (the CUDA transport:
                                      the GPU posts GO and cannot wake a sleeper) (line 4)
  ABORT main (watchdog), GPU        nonzero: the GPU's wait for a job's FIN gives up (a worker
        a failing worker              died, stalled or failed its job; the host raises) (line 8, beside FIN)
  ASLEEP worker w         main        1 while w may be blocked in a futex wait on its GO word
                                      (same line, word 4): main then wakes it after posting GO
                                      (atomics.sleep_until_changed / post_and_wake)
"""
import numpy as np

LINE = 8  # int64 words per 64-byte cache line
F32, BF16, F16 = 0, 1, 2                        # storage dtype codes (S_CODE; the kernels' and the GPU's)
CMD, LAYER, QLEN, WINDOW, NSPLIT, UNITS, PSPLIT, NGROUPS = 8, 9, 10, 11, 12, 13, 14, 15
F_SCALE, F_SOFTCAP = 16, 17                     # float64 words
S_BATCH, S_HQ, S_HKV, S_HDIM, S_CAP, S_LAYERS, S_CODE, S_TMAX = range(24, 32)
S_NSPLIT_MAX = 32
S_GROUPS, S_PRIVATE = 21, 22                    # shared-prefix groups; rows K/V hold per request
S_RING, S_RING_LAYERS = 35, 36                   # ring rows and ring layers (sliding windows, arena.ring_plan)
ARG0, ARG1 = 33, 34
POP_RANGES = (9, 10, 11, 12)                    # CMD_POPULATE's params (attention params' words)
AWAKE = 37
S_BLOCKS, S_MAXBLK = 38, 39
NAME_WORD, NAME_BYTES = 40, 128                 # lines 5-6
TICKET = 56                                     # line 7, alone: every taker hits it
FIN = 64                                        # line 8, alone
PARENT_BUSY = 65                                # the parent's BUSY word (it takes units too)
ABORT = 66
DONE_LINE = 9
CMD_BITS = 4                                    # GO = seq << CMD_BITS | cmd


def go(seq, cmd):
    return seq << CMD_BITS | cmd


def go_seq(value):
    return value >> CMD_BITS


def go_cmd(value):
    return value & ((1 << CMD_BITS) - 1)


def ticket(seq, units):
    """The TICKET word of attention job `seq` with `units` units (atomics.claim takes them)."""
    return ticket_tag(seq) << 32 | units


TAG_MASK = 0x7FFFFFFF                           # the job-number bits a ticket carries


def ticket_tag(seq):
    return seq & TAG_MASK


def done_word(rank):
    return (DONE_LINE + rank) * LINE


def err_word(rank):
    return done_word(rank) + 1


def go_word(rank):
    return done_word(rank) + 2


def busy_word(rank):
    return done_word(rank) + 3


def asleep_word(rank):
    return done_word(rank) + 4


ASLEEP_FROM_GO = 2                              # asleep_word(r) - go_word(r)


def nbytes(nworkers):
    return (DONE_LINE + nworkers) * LINE * 8


# commands
CMD_PING, CMD_OPEN, CMD_CLOSE, CMD_ATTN, CMD_EXIT = 1, 2, 3, 4, 5
CMD_LORA_OPEN, CMD_ADAPTER_MAP, CMD_ADAPTER_DROP, CMD_LORA = 6, 7, 8, 9
CMD_POPULATE = 10     # fault in pages of the session segment (hetero.offload.pinning), data untouched
CMD_LORA_GPU = 11     # LoRA deltas of one decode token per request, posted by the GPU (layout.run_rows)


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

/*
 * The mono path's fault word (SPEC §5): int32 [4] = code, layer, row, value.
 * Fused executors (CPU and GPU) set it, first fault wins, instead of
 * faulting on what they can detect; after each step the lifecycle checks it
 * (GPU: a device-side assert; CPU: an error). Sticky until cleared.
 */
#ifndef M3_MONO_FAULT_H
#define M3_MONO_FAULT_H

enum m3_mono_fault {
    M3_MONO_FAULT_NONE = 0,
    M3_MONO_FAULT_SLOT = 1,      /* a row's slot is past the page pool */
    M3_MONO_FAULT_PAGE = 2,      /* a block table entry is past the pool */
    M3_MONO_FAULT_PEER_WAIT = 3, /* a peer's push did not arrive in time */
    M3_MONO_FAULT_ABORTED = 4,   /* the step was aborted (a failure on some rank) */
    M3_MONO_FAULT_PLANTED = 5,   /* tests */
};

/* Each code's name, for the host's messages and the device's printf alike:
 * X(code, name). */
#define M3_MONO_FAULT_NAMES(X)                                  \
    X(M3_MONO_FAULT_NONE, "no fault")                           \
    X(M3_MONO_FAULT_SLOT, "slot out of range")                  \
    X(M3_MONO_FAULT_PAGE, "block table page out of range")      \
    X(M3_MONO_FAULT_PEER_WAIT, "a TP peer did not arrive in time") \
    X(M3_MONO_FAULT_ABORTED, "step aborted")                    \
    X(M3_MONO_FAULT_PLANTED, "planted fault")

#ifdef __cplusplus
extern "C" {
#endif
/* "slot out of range", ... ("unknown fault" for other codes). */
const char *m3_mono_fault_name(int code);
#ifdef __cplusplus
}
#endif

#endif

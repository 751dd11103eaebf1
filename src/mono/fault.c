/*
 * Names of the mono path's fault codes, for messages (every build).
 */
#include "mono/fault.h"

const char *m3_mono_fault_name(int code) {
    switch (code) {
    case M3_MONO_FAULT_NONE: return "no fault";
    case M3_MONO_FAULT_SLOT: return "slot out of range";
    case M3_MONO_FAULT_PAGE: return "block table page out of range";
    case M3_MONO_FAULT_PEER_WAIT: return "a TP peer did not arrive in time";
    case M3_MONO_FAULT_ABORTED: return "step aborted";
    case M3_MONO_FAULT_PLANTED: return "planted fault";
    default: return "unknown fault";
    }
}

/*
 * Names of the mono path's fault codes, for messages (every build).
 */
#include "mono/fault.h"

#define M3_FAULT_CASE(code, name) \
    case code:                    \
        return name;

const char *m3_mono_fault_name(int code) {
    switch (code) {
        M3_MONO_FAULT_NAMES(M3_FAULT_CASE)
    default:
        return "unknown fault";
    }
}

/*
 * config.json text (SPEC §2.1: flat or under text_config, released and
 * flattened spellings). Properties: a refusal has a message; an accepted
 * config renders back to config.json (m3_config_to_json), that text parses
 * again, and renders to the same text (the render is a fixed point, so
 * synth's checkpoints describe the config they were made from). The same
 * text also goes through the DSpark drafter's parser, with the same
 * properties for its render (m3_draft_config_to_json).
 */
#include "fuzz.h"

static void draft_config(const uint8_t *data, size_t size) {
    m3_draft_config a, b;
    m3_status st = m3_draft_config_parse((const char *)data, size, &a);
    fuzz_check_refusal(st, "m3_draft_config_parse");
    if (st != M3_OK)
        return;
    char *text_a = NULL, *text_b = NULL;
    if (m3_draft_config_to_json(&a, &text_a) != M3_OK)
        fuzz_fail("an accepted drafter config does not render: %s", m3_last_error());
    if (m3_draft_config_parse(text_a, strlen(text_a), &b) != M3_OK)
        fuzz_fail("the render of an accepted drafter config is refused: %s\n%s",
                  m3_last_error(), text_a);
    if (m3_draft_config_to_json(&b, &text_b) != M3_OK)
        fuzz_fail("a re-parsed drafter config does not render: %s", m3_last_error());
    if (strcmp(text_a, text_b) != 0)
        fuzz_fail("render, parse, render changes the drafter config:\n%s\n---\n%s", text_a,
                  text_b);
    free(text_a);
    free(text_b);
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    draft_config(data, size);
    m3_config a, b;
    m3_status st = m3_config_parse((const char *)data, size, &a);
    fuzz_check_refusal(st, "m3_config_parse");
    if (st != M3_OK)
        return 0;
    char *text_a = NULL, *text_b = NULL;
    st = m3_config_to_json(&a, &text_a);
    if (st != M3_OK)
        fuzz_fail("an accepted config does not render: %s", m3_last_error());
    st = m3_config_parse(text_a, strlen(text_a), &b);
    if (st != M3_OK)
        fuzz_fail("the render of an accepted config is refused: %s\n%s", m3_last_error(), text_a);
    st = m3_config_to_json(&b, &text_b);
    if (st != M3_OK)
        fuzz_fail("a re-parsed config does not render: %s", m3_last_error());
    if (strcmp(text_a, text_b) != 0)
        fuzz_fail("render, parse, render changes the config:\n%s\n---\n%s", text_a, text_b);
    free(text_a);
    free(text_b);
    return 0;
}

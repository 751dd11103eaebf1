/*
 * Tests for cache/cache.c, the page allocator and per-sequence block tables
 * of SPEC §4: argument checks of m3_cache_init; sequences created, freed and
 * reused, and the error when all are in use; block tables that grow page by
 * page as tokens are reserved (1 and 128 tokens hold one page, 129 two);
 * pages distinct across sequences and slots = page·128 + offset; running out
 * of pages failing with M3_ERR_OUT_OF_PAGES and leaving the sequence as it
 * was; trim giving pages back for reuse; the context limit; and freeing a
 * sequence that does not exist; a pool that drains handing out its pages in
 * the first order again. After every step the pool is audited: each page is
 * either free or held by exactly one live sequence.
 */
#include <stdlib.h>
#include <string.h>

#include "cache/cache.h"
#include "check.h"

/* Every page id is in [0, n_pages) and appears exactly once among the free
 * stack and the block tables of live sequences. */
static int pool_consistent(const m3_cache *c) {
    int *seen = calloc((size_t)c->n_pages, sizeof *seen);
    int ok = seen != NULL;
    for (int i = 0; ok && i < c->n_free; i++) {
        int32_t p = c->free_pages[i];
        ok = p >= 0 && p < c->n_pages && !seen[p]++;
    }
    int held = 0;
    for (int s = 0; ok && s < c->max_seqs; s++) {
        if (!c->seqs[s].live)
            continue;
        ok = c->seqs[s].n_blocks <= c->max_blocks;
        for (int b = 0; ok && b < c->seqs[s].n_blocks; b++) {
            int32_t p = c->seqs[s].pages[b];
            ok = p >= 0 && p < c->n_pages && !seen[p]++;
        }
        held += c->seqs[s].n_blocks;
    }
    ok = ok && held + c->n_free == c->n_pages;
    free(seen);
    return ok;
}

static void test_init_args(void) {
    m3_cache c;
    CHECK_FAILS(m3_cache_init(&c, 2, 0, 1024, 4), M3_ERR_INVALID_ARG, "cache pages = 0");
    CHECK_FAILS(m3_cache_init(&c, 2, -5, 1024, 4), M3_ERR_INVALID_ARG, "cache pages = -5");
    CHECK_FAILS(m3_cache_init(&c, 2, 8, 1024, 0), M3_ERR_INVALID_ARG, "max_seqs = 0");
    CHECK_FAILS(m3_cache_init(&c, 2, 8, 1024, -1), M3_ERR_INVALID_ARG, "max_seqs = -1");
    CHECK_FAILS(m3_cache_init(&c, 2, 8, 1024, (1 << 20) + 1), M3_ERR_INVALID_ARG,
                "max_seqs = 1048577");
    CHECK_FAILS(m3_cache_init(&c, 2, 8, 0, 4), M3_ERR_INVALID_ARG, "max_context = 0");
    CHECK_FAILS(m3_cache_init(&c, 2, 8, -128, 4), M3_ERR_INVALID_ARG, "max_context = -128");
    /* a refused init leaves nothing to free, and destroy is safe on it */
    CHECK(c.free_pages == NULL && c.seqs == NULL && c.layers == NULL);
    m3_cache_destroy(&c);

    CHECK_OK(m3_cache_init(&c, 3, 8, 1000, 4));
    CHECK(c.n_pages == 8 && c.n_free == 8 && c.max_seqs == 4 && c.num_layers == 3);
    CHECK(c.max_context == 1000 && c.max_blocks == 8); /* ceil(1000 / 128) */
    CHECK(c.layers != NULL && c.layers[2].k == NULL && c.layers[2].index == NULL);
    CHECK(pool_consistent(&c));
    m3_cache_destroy(&c);
    CHECK(c.seqs == NULL && c.n_pages == 0);
    m3_cache_destroy(&c); /* twice is harmless: destroy zeroes the struct */
}

static void test_sequences(void) {
    m3_cache c;
    CHECK_OK(m3_cache_init(&c, 1, 16, 4096, 3));
    int a = -1, b = -1, d = -1, e = -1;
    CHECK_OK(m3_cache_seq_create(&c, &a));
    CHECK_OK(m3_cache_seq_create(&c, &b));
    CHECK_OK(m3_cache_seq_create(&c, &d));
    CHECK(a == 0 && b == 1 && d == 2);
    CHECK_OK(m3_cache_seq_check(&c, b));
    CHECK(c.seqs[b].len == 0 && c.seqs[b].n_blocks == 0);

    e = 77;
    CHECK_FAILS(m3_cache_seq_create(&c, &e), M3_ERR_INVALID_ARG, "all 3 sequences are in use");
    CHECK(e == 77);

    /* a freed id is handed out again, empty, with its pages back in the pool */
    CHECK_OK(m3_cache_reserve(&c, b, 300));
    c.seqs[b].len = 300;
    CHECK(c.seqs[b].n_blocks == 3 && c.n_free == 13);
    CHECK_OK(m3_cache_seq_free(&c, b));
    CHECK(c.n_free == 16 && pool_consistent(&c));
    CHECK_FAILS(m3_cache_seq_check(&c, b), M3_ERR_INVALID_ARG, "sequence 1 does not exist");
    CHECK_OK(m3_cache_seq_create(&c, &e));
    CHECK(e == 1 && c.seqs[e].len == 0 && c.seqs[e].n_blocks == 0);
    CHECK(pool_consistent(&c));

    /* freeing what does not exist */
    CHECK_FAILS(m3_cache_seq_free(&c, -1), M3_ERR_INVALID_ARG, "sequence -1 does not exist");
    CHECK_FAILS(m3_cache_seq_free(&c, 3), M3_ERR_INVALID_ARG, "sequence 3 does not exist");
    CHECK_FAILS(m3_cache_seq_free(&c, 1 << 30), M3_ERR_INVALID_ARG, "does not exist");
    CHECK_OK(m3_cache_seq_free(&c, a));
    CHECK_FAILS(m3_cache_seq_free(&c, a), M3_ERR_INVALID_ARG, "sequence 0 does not exist");
    /* nor can a freed sequence reserve */
    CHECK_FAILS(m3_cache_reserve(&c, a, 10), M3_ERR_INVALID_ARG, "sequence 0 does not exist");
    CHECK_FAILS(m3_cache_reserve(&c, 9, 10), M3_ERR_INVALID_ARG, "sequence 9 does not exist");
    CHECK(c.n_free == 16 && pool_consistent(&c));
    m3_cache_destroy(&c);
}

static void test_reserve_and_slots(void) {
    m3_cache c;
    CHECK_OK(m3_cache_init(&c, 2, 32, 8192, 4));
    int a, b;
    CHECK_OK(m3_cache_seq_create(&c, &a));
    CHECK_OK(m3_cache_seq_create(&c, &b));

    /* the table grows a page at each 128-token boundary, never before */
    static const struct { int64_t len; int blocks; } steps[] = {
        {0, 0}, {1, 1}, {127, 1}, {128, 1}, {129, 2}, {256, 2}, {257, 3}, {640, 5},
    };
    for (size_t i = 0; i < sizeof steps / sizeof steps[0]; i++) {
        CHECK_OK(m3_cache_reserve(&c, a, steps[i].len));
        CHECK(c.seqs[a].n_blocks == steps[i].blocks);
        CHECK(c.n_free == 32 - steps[i].blocks);
    }
    /* low page ids first */
    CHECK(c.seqs[a].pages[0] == 0);
    /* reserving less than held keeps the pages (trim gives them back) */
    CHECK_OK(m3_cache_reserve(&c, a, 10));
    CHECK(c.seqs[a].n_blocks == 5);
    /* the table's first blocks do not move as it grows */
    int32_t first[5];
    memcpy(first, c.seqs[a].pages, sizeof first);

    /* interleave the two sequences so their pages alternate in the pool */
    CHECK_OK(m3_cache_reserve(&c, b, 100));
    CHECK_OK(m3_cache_reserve(&c, a, 700));
    CHECK_OK(m3_cache_reserve(&c, b, 400));
    CHECK(c.seqs[a].n_blocks == 6 && c.seqs[b].n_blocks == 4);
    CHECK(memcmp(first, c.seqs[a].pages, sizeof first) == 0);
    CHECK(pool_consistent(&c));

    /* slot = page * 128 + offset, and no two tokens of any sequence share one */
    const int64_t lens[2] = {700, 400};
    const int seqs[2] = {a, b};
    char *used = calloc((size_t)c.n_pages * M3_PAGE_TOKENS, 1);
    CHECK(used != NULL);
    for (int k = 0; used && k < 2; k++) {
        const m3_seq_state *s = &c.seqs[seqs[k]];
        for (int64_t pos = 0; pos < lens[k]; pos++) {
            int64_t slot = m3_cache_slot(&c, seqs[k], pos);
            int64_t want = (int64_t)s->pages[pos / 128] * 128 + pos % 128;
            bool in_pool = slot >= 0 && slot < (int64_t)c.n_pages * 128;
            if (slot != want || !in_pool || used[slot]) {
                CHECK(slot == want && in_pool && !used[slot]);
                break;
            }
            used[slot] = 1;
        }
    }
    free(used);
    CHECK(m3_cache_slot(&c, a, 0) == (int64_t)c.seqs[a].pages[0] * 128);
    CHECK(m3_cache_slot(&c, a, 129) == (int64_t)c.seqs[a].pages[1] * 128 + 1);
    CHECK(m3_cache_slot(&c, b, 399) == (int64_t)c.seqs[b].pages[3] * 128 + 15);
    m3_cache_destroy(&c);
}

static void test_out_of_pages(void) {
    m3_cache c;
    CHECK_OK(m3_cache_init(&c, 1, 4, 4096, 3));
    int a, b;
    CHECK_OK(m3_cache_seq_create(&c, &a));
    CHECK_OK(m3_cache_seq_create(&c, &b));
    CHECK_OK(m3_cache_reserve(&c, a, 3 * 128));

    /* b needs 2 pages, 1 is free: nothing is taken */
    CHECK_FAILS(m3_cache_reserve(&c, b, 2 * 128), M3_ERR_OUT_OF_PAGES,
                "out of KV cache pages: sequence 1 needs 2 more, 1 of 4 are free");
    CHECK(c.seqs[b].n_blocks == 0 && c.n_free == 1);
    CHECK(pool_consistent(&c));

    /* b takes the last page; growing either sequence now fails, all or nothing */
    CHECK_OK(m3_cache_reserve(&c, b, 128));
    int32_t b_page = c.seqs[b].pages[0];
    CHECK_FAILS(m3_cache_reserve(&c, b, 129), M3_ERR_OUT_OF_PAGES, "needs 1 more, 0 of 4");
    CHECK_FAILS(m3_cache_reserve(&c, a, 5 * 128), M3_ERR_OUT_OF_PAGES, "sequence 0 needs 2 more");
    CHECK(c.seqs[a].n_blocks == 3 && c.seqs[b].n_blocks == 1 && c.n_free == 0);
    CHECK(c.seqs[b].pages[0] == b_page);
    /* a reservation inside the held pages still succeeds with the pool empty */
    CHECK_OK(m3_cache_reserve(&c, b, 128));
    CHECK_OK(m3_cache_reserve(&c, a, 300));
    CHECK(pool_consistent(&c));

    /* a third sequence can be created (it holds no pages) but not grown */
    int d;
    CHECK_OK(m3_cache_seq_create(&c, &d));
    CHECK_FAILS(m3_cache_reserve(&c, d, 1), M3_ERR_OUT_OF_PAGES, "out of KV cache pages");
    CHECK(c.seqs[d].n_blocks == 0);

    /* freeing a sequence makes its pages available again */
    CHECK_OK(m3_cache_seq_free(&c, a));
    CHECK(c.n_free == 3);
    CHECK_OK(m3_cache_reserve(&c, d, 3 * 128));
    CHECK(c.seqs[d].n_blocks == 3 && c.n_free == 0 && pool_consistent(&c));
    m3_cache_destroy(&c);
}

static void test_trim(void) {
    m3_cache c;
    CHECK_OK(m3_cache_init(&c, 1, 8, 4096, 2));
    int a, b;
    CHECK_OK(m3_cache_seq_create(&c, &a));
    CHECK_OK(m3_cache_seq_create(&c, &b));
    CHECK_OK(m3_cache_reserve(&c, a, 5 * 128));
    int32_t a_pages[5];
    memcpy(a_pages, c.seqs[a].pages, sizeof a_pages);

    /* 130 tokens need 2 pages: the last 3 go back, the first 2 stay put */
    m3_cache_trim(&c, a, 130);
    CHECK(c.seqs[a].n_blocks == 2 && c.n_free == 6);
    CHECK(c.seqs[a].pages[0] == a_pages[0] && c.seqs[a].pages[1] == a_pages[1]);
    CHECK(pool_consistent(&c));
    /* trimming to more than is held, or to the same, changes nothing */
    m3_cache_trim(&c, a, 4096);
    m3_cache_trim(&c, a, 256);
    CHECK(c.seqs[a].n_blocks == 2 && c.n_free == 6);

    /* the given-back pages are reused: b gets exactly those three */
    CHECK_OK(m3_cache_reserve(&c, b, 3 * 128 + 3 * 128)); /* 6 pages: 3 returned + 3 never used */
    int reused = 0;
    for (int i = 0; i < c.seqs[b].n_blocks; i++)
        for (int k = 2; k < 5; k++)
            reused += c.seqs[b].pages[i] == a_pages[k];
    CHECK(reused == 3 && c.n_free == 0);
    /* the pool is now empty; a trim is what lets a grow again */
    CHECK_FAILS(m3_cache_reserve(&c, a, 3 * 128), M3_ERR_OUT_OF_PAGES, "needs 1 more");
    int32_t b_last = c.seqs[b].pages[5];
    m3_cache_trim(&c, b, 5 * 128);
    CHECK_OK(m3_cache_reserve(&c, a, 3 * 128));
    CHECK(c.seqs[a].pages[2] == b_last);
    CHECK(pool_consistent(&c));

    /* trim to 0 returns everything; the sequence stays live and can grow */
    m3_cache_trim(&c, a, 0);
    CHECK(c.seqs[a].n_blocks == 0 && c.n_free == 3);
    CHECK_OK(m3_cache_seq_check(&c, a));
    CHECK_OK(m3_cache_reserve(&c, a, 1));
    CHECK(pool_consistent(&c));
    m3_cache_destroy(&c);
}

static void test_context_limit(void) {
    m3_cache c;
    /* 300 tokens: 3 pages per sequence at most, with plenty in the pool */
    CHECK_OK(m3_cache_init(&c, 1, 16, 300, 2));
    CHECK(c.max_blocks == 3);
    int a;
    CHECK_OK(m3_cache_seq_create(&c, &a));
    CHECK_OK(m3_cache_reserve(&c, a, 300));
    CHECK(c.seqs[a].n_blocks == 3);
    CHECK_FAILS(m3_cache_reserve(&c, a, 301), M3_ERR_INVALID_ARG,
                "sequence 0 would hold 301 tokens; the context limit is 300");
    CHECK(c.seqs[a].n_blocks == 3 && c.n_free == 13);
    m3_cache_trim(&c, a, 0);
    CHECK_FAILS(m3_cache_reserve(&c, a, 1 << 20), M3_ERR_INVALID_ARG, "context limit is 300");
    CHECK(c.seqs[a].n_blocks == 0 && c.n_free == 16);
    m3_cache_destroy(&c);

    /* a limit that is a whole number of pages */
    CHECK_OK(m3_cache_init(&c, 1, 16, 256, 1));
    CHECK(c.max_blocks == 2);
    CHECK_OK(m3_cache_seq_create(&c, &a));
    CHECK_OK(m3_cache_reserve(&c, a, 256));
    CHECK_FAILS(m3_cache_reserve(&c, a, 257), M3_ERR_INVALID_ARG, "context limit is 256");
    CHECK(c.seqs[a].n_blocks == 2);
    m3_cache_destroy(&c);
}

/* Many sequences growing and shrinking in a fixed pseudo-random order: the
 * pool stays consistent throughout and is whole again at the end. */
static void test_churn(void) {
    m3_cache c;
    enum { SEQS = 6, PAGES = 40 };
    CHECK_OK(m3_cache_init(&c, 1, PAGES, 2048, SEQS));
    int live[SEQS] = {0};
    int64_t len[SEQS] = {0};
    uint32_t x = 12345;
    int bad = 0, oop = 0;
    for (int step = 0; step < 4000 && !bad; step++) {
        x = x * 1664525u + 1013904223u;
        int s = (int)((x >> 8) % SEQS), op = (int)((x >> 20) % 8);
        if (!live[s]) {
            int id;
            if (m3_cache_seq_create(&c, &id) != M3_OK) {
                bad = 1;
                break;
            }
            live[id] = 1;
            len[id] = 0;
            continue;
        }
        if (op == 0) {
            bad |= m3_cache_seq_free(&c, s) != M3_OK;
            live[s] = 0;
        } else if (op <= 2) {
            len[s] = len[s] / 2;
            m3_cache_trim(&c, s, len[s]);
            bad |= c.seqs[s].n_blocks != (int)((len[s] + 127) / 128);
        } else {
            int64_t want = len[s] + (int64_t)((x >> 4) % 300);
            if (want > 2048)
                want = 2048;
            int before = c.seqs[s].n_blocks, free_before = c.n_free;
            m3_status st = m3_cache_reserve(&c, s, want);
            if (st == M3_OK)
                len[s] = want;
            else if (st == M3_ERR_OUT_OF_PAGES) {
                oop++;
                bad |= c.seqs[s].n_blocks != before || c.n_free != free_before;
            } else {
                bad = 1;
            }
        }
        bad |= !pool_consistent(&c);
    }
    CHECK(!bad);
    CHECK(oop > 0); /* the pool did run dry along the way */
    for (int s = 0; s < SEQS; s++)
        if (live[s])
            CHECK_OK(m3_cache_seq_free(&c, s));
    CHECK(c.n_free == PAGES && pool_consistent(&c));
    m3_cache_destroy(&c);
}

/* Once every page is back, the pool hands pages out in its first order
 * again (low ids first), whatever order they came back in; while any page
 * is held, freed pages are reused first (no reordering of a live pool). */
static void test_drain_restores_order(void) {
    m3_cache c;
    CHECK_OK(m3_cache_init(&c, 1, 12, 4096, 3));
    int a, b;
    CHECK_OK(m3_cache_seq_create(&c, &a));
    CHECK_OK(m3_cache_seq_create(&c, &b));
    /* interleave a and b so the pages come back out of order */
    for (int64_t len = 128; len <= 4 * 128; len += 128) {
        CHECK_OK(m3_cache_reserve(&c, a, len));
        CHECK_OK(m3_cache_reserve(&c, b, len));
    }
    CHECK(c.seqs[a].pages[1] == 2 && c.seqs[b].pages[1] == 3);
    int32_t b_first = c.seqs[b].pages[0];
    CHECK_OK(m3_cache_seq_free(&c, a));
    CHECK_OK(m3_cache_seq_free(&c, b));
    CHECK(c.n_free == 12 && pool_consistent(&c));
    int d;
    CHECK_OK(m3_cache_seq_create(&c, &d));
    CHECK_OK(m3_cache_reserve(&c, d, 6 * 128));
    int in_order = 1;
    for (int i = 0; i < 6; i++)
        in_order &= c.seqs[d].pages[i] == i;
    CHECK(in_order);
    /* a live pool is not reordered: the next sequence gets what d gave back */
    CHECK_OK(m3_cache_seq_create(&c, &a));
    CHECK_OK(m3_cache_reserve(&c, a, 128));
    int32_t a_page = c.seqs[a].pages[0];
    m3_cache_trim(&c, d, 3 * 128);
    CHECK_OK(m3_cache_seq_create(&c, &b));
    CHECK_OK(m3_cache_reserve(&c, b, 128));
    CHECK(c.seqs[b].pages[0] == 3 && a_page == 6 && b_first == 1);
    /* draining by trim (the sequence stays live, holding nothing) also restores */
    CHECK_OK(m3_cache_seq_free(&c, a));
    CHECK_OK(m3_cache_seq_free(&c, b));
    m3_cache_trim(&c, d, 0);
    CHECK_OK(m3_cache_reserve(&c, d, 2 * 128));
    CHECK(c.seqs[d].pages[0] == 0 && c.seqs[d].pages[1] == 1 && pool_consistent(&c));
    m3_cache_destroy(&c);
}

int main(void) {
    test_init_args();
    test_sequences();
    test_reserve_and_slots();
    test_out_of_pages();
    test_trim();
    test_context_limit();
    test_churn();
    test_drain_restores_order();
    return check_summary("test_cache");
}

/* runner.c — main() of mok's test program and the helpers every suite shares.
 *
 *   mok_tests [-k NAME | NAME] [--seed N] [--list]
 *
 * Runs every case of every suite in order (those whose "suite.case" contains NAME),
 * one line per case, and "N passed, M failed" last (", K not run": cases this machine
 * cannot run, e.g. with one GPU where two are needed); exits 1 when any failed. The seed
 * (default: from the clock) is printed first; every case draws its inputs from it
 * mixed with the case's name, so `--seed N -k NAME` replays one failure. */
#define _POSIX_C_SOURCE 200809L
#include <math.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "runner.h"

static const struct {
  const char* name;
  const test_case_t* cases;
} suites[] = {
#ifdef MOK_GPU_TESTS /* mok_gpu_tests: the CUDA backend (tests/gpu/) */
    {"gpu", suite_gpu},
#ifdef MOK_HAVE_NCCL
    {"comm", suite_gpu_comm},
#endif
#else
    {"validation", suite_validation}, {"grad", suite_grad},   {"numerics", suite_numerics},
    {"determinism", suite_determinism}, {"edge", suite_edge},         {"fuzz", suite_fuzz},
#endif
};

uint64_t test_seed;
const char* test_current = "";

/* ---- what a case allocated, released after it ---- */

typedef enum { OWN_MEMORY, OWN_PROBLEM, OWN_CONTEXT, OWN_COMM } own_kind_t;
typedef struct {
  own_kind_t kind;
  void* ptr;
} owned_t;
static owned_t* owned;
static size_t num_owned, cap_owned;

static void* own(own_kind_t kind, void* ptr) {
  if (!ptr) return NULL;
  if (num_owned == cap_owned) {
    cap_owned = cap_owned ? 2 * cap_owned : 64;
    owned = realloc(owned, cap_owned * sizeof *owned);
    if (!owned) abort();
  }
  owned[num_owned++] = (owned_t){kind, ptr};
  return ptr;
}

static void release_all(void) {
  for (int pass = 0; pass < 3; pass++) /* contexts before comms before memory */
    for (size_t i = num_owned; i-- > 0;) {
      owned_t* o = &owned[i];
      if (!o->ptr) continue;
      if (pass == 0 && o->kind == OWN_CONTEXT) mok_context_destroy(o->ptr);
      else if (pass == 1 && o->kind == OWN_COMM) mok_cpu_comm_destroy(o->ptr);
      else if (pass == 2 && o->kind == OWN_PROBLEM) mok_problem_destroy(o->ptr);
      else if (pass == 2 && o->kind == OWN_MEMORY) free(o->ptr);
      else continue;
      o->ptr = NULL;
    }
  num_owned = 0;
}

static uint64_t fnv1a(const char* s) {
  uint64_t h = 0xcbf29ce484222325ull;
  for (; *s; s++) h = (h ^ (uint8_t)*s) * 0x100000001b3ull;
  return h;
}

uint64_t test_case_seed(void) { return test_seed ^ fnv1a(test_current); }

uint64_t test_next(uint64_t* state) {
  uint64_t z = (*state += 0x9e3779b97f4a7c15ull);
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  return z ^ (z >> 31);
}

uint16_t test_bf16(float f) {
  uint32_t u;
  memcpy(&u, &f, 4);
  return (uint16_t)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}

void* test_alloc(size_t bytes) {
  size_t n = bytes ? (bytes + 255) / 256 * 256 : 256;
  void* p = aligned_alloc(256, n);
  if (!p) abort();
  memset(p, 0, n);
  return own(OWN_MEMORY, p);
}

mok_problem_t* test_problem(const mok_config_t* cfg, int64_t T_global, uint64_t seed) {
  mok_problem_t* p = NULL;
  mok_status_t s = mok_problem_create(cfg, T_global, seed, &p);
  if (s) printf("    mok_problem_create: %s\n", mok_status_string(s));
  return own(OWN_PROBLEM, p);
}

mok_context_t* test_context(const mok_config_t* cfg, mok_status_t* status) {
  mok_context_t* ctx = NULL;
  mok_status_t s = mok_context_create(cfg, &ctx);
  if (status) *status = s;
  if (s) printf("    mok_context_create: %s: %s\n", mok_status_string(s), mok_last_create_error());
  return s ? NULL : own(OWN_CONTEXT, ctx);
}

void test_context_destroy(mok_context_t* ctx) {
  for (size_t i = 0; i < num_owned; i++)
    if (owned[i].kind == OWN_CONTEXT && owned[i].ptr == ctx) owned[i].ptr = NULL;
  mok_context_destroy(ctx);
}

mok_cpu_comm_t* test_comm(int num_ranks) {
  mok_cpu_comm_t* c = NULL;
  if (mok_cpu_comm_create(num_ranks, &c)) return NULL;
  return own(OWN_COMM, c);
}

mok_status_t test_run(mok_problem_t* p, const mok_run_opts_t* opts) {
  char err[512] = "";
  mok_status_t s = mok_problem_run(p, opts, err, sizeof err);
  if (s) printf("    run (W = %d): %s: %s\n", opts->W, mok_status_string(s), err);
  return s;
}

/* ---- comparing outputs ---- */

void test_snapshot(const mok_problem_t* p, int with_backward, test_outputs_t* out) {
  out->n = mok_problem_outputs(p, with_backward, out->v, MOK_PROBLEM_MAX_OUTPUTS);
  for (int i = 0; i < out->n; i++) {
    size_t bytes = (size_t)out->v[i].count * out->v[i].elem;
    void* copy = test_alloc(bytes);
    memcpy(copy, out->v[i].data, bytes);
    out->v[i].data = copy;
  }
}

const mok_tensor_view_t* test_view(const test_outputs_t* s, const char* name) {
  for (int i = 0; i < s->n; i++)
    if (strcmp(s->v[i].name, name) == 0) return &s->v[i];
  return NULL;
}

/* Is `name` one of the space-separated words of `list` (NULL = every name)? */
static int in_list(const char* list, const char* name) {
  if (!list) return 1;
  size_t n = strlen(name);
  for (const char* q = list; (q = strstr(q, name)) != NULL; q += n)
    if ((q == list || q[-1] == ' ') && (q[n] == ' ' || q[n] == '\0')) return 1;
  return 0;
}

int test_same_bits(const test_outputs_t* a, const test_outputs_t* b, const char* names,
                   const char* what) {
  int bad = 0;
  for (int i = 0; i < b->n; i++) {
    const mok_tensor_view_t* vb = &b->v[i];
    if (!in_list(names, vb->name)) continue;
    const mok_tensor_view_t* va = test_view(a, vb->name);
    if (!va) {
      printf("    %s: %s missing\n", what, vb->name);
      bad++;
      continue;
    }
    int64_t d = mok_first_difference(va, vb);
    if (d < 0) continue;
    bad++;
    if (va->count != vb->count || va->elem != vb->elem)
      printf("    %s: %s has %lld x %zu B against %lld x %zu B\n", what, vb->name,
             (long long)va->count, va->elem, (long long)vb->count, vb->elem);
    else
      printf("    %s: %s differs first at [%lld]: %.9g against %.9g\n", what, vb->name,
             (long long)d, mok_view_get(va, d), mok_view_get(vb, d));
  }
  return bad;
}

int test_close(const test_outputs_t* a, const test_outputs_t* b, const char* names, double tol,
               const char* what) {
  int bad = 0;
  for (int i = 0; i < b->n; i++) {
    const mok_tensor_view_t* vb = &b->v[i];
    if (!in_list(names, vb->name)) continue;
    const mok_tensor_view_t* va = test_view(a, vb->name);
    double err = va && va->count == vb->count ? mok_relative_error(va, vb) : INFINITY;
    if (!(err <= tol)) {
      printf("    %s: %s relative error %.3g > %.3g\n", what, vb->name, err, tol);
      bad++;
    }
  }
  return bad;
}

/* ---- main ---- */

static double now_s(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

int main(int argc, char** argv) {
  const char* filter = NULL;
  int list = 0, have_seed = 0;
  for (int i = 1; i < argc; i++) {
    if (strcmp(argv[i], "-k") == 0 && i + 1 < argc) {
      filter = argv[++i];
    } else if (strcmp(argv[i], "--seed") == 0 && i + 1 < argc) {
      test_seed = strtoull(argv[++i], NULL, 0);
      have_seed = 1;
    } else if (strcmp(argv[i], "--list") == 0) {
      list = 1;
    } else if (argv[i][0] != '-') {
      filter = argv[i];
    } else {
      fprintf(stderr, "usage: %s [-k NAME | NAME] [--seed N] [--list]\n", argv[0]);
      return 2;
    }
  }
  if (!have_seed) {
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts);
    test_seed = ((uint64_t)ts.tv_sec * 1000000007ull) ^ (uint64_t)ts.tv_nsec;
  }
  if (!list) printf("seed: %llu\n", (unsigned long long)test_seed);
  int passed = 0, failed = 0, not_run = 0;
  char full[256];
  for (size_t s = 0; s < sizeof suites / sizeof suites[0]; s++)
    for (const test_case_t* c = suites[s].cases; c->name; c++) {
      snprintf(full, sizeof full, "%s.%s", suites[s].name, c->name);
      if (filter && !strstr(full, filter)) continue;
      if (list) {
        printf("%s\n", full);
        continue;
      }
      test_current = full;
      fflush(stdout);
      double t0 = now_s();
      int rc = c->fn();
      double dt = now_s() - t0;
      release_all();
      if (rc == 0) {
        passed++;
        printf("ok   %s (%.2f s)\n", full, dt);
      } else if (rc == TEST_NOT_RUN) {
        not_run++;
        printf("-    %s (not run)\n", full);
      } else {
        failed++;
        printf("FAIL %s\n", full);
      }
      fflush(stdout);
    }
  free(owned);
  if (list) return 0;
  if (not_run) printf("%d passed, %d failed, %d not run\n", passed, failed, not_run);
  else printf("%d passed, %d failed\n", passed, failed);
  return failed ? 1 : 0;
}

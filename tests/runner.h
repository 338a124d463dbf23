/* runner.h — mok's one test runner: a case is a function returning 0 on pass; the
 * runner prints a line per case and "N passed, N failed" last (", N not run" when a
 * case could not run here). Helpers below fill
 * random inputs from the printed seed and compare results by bytes or by norm. */
#ifndef MOK_TESTS_RUNNER_H
#define MOK_TESTS_RUNNER_H
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>

typedef struct {
  const char* name;
  int (*fn)(void); /* 0 = pass; on failure print a reason with TEST_FAIL first; TEST_NOT_RUN */
} test_case_t;

/* What a case returns when this machine cannot run it (say why first): counted apart,
 * neither passed nor failed. Negative, so that a case returning its count of failures
 * (any positive number) is never taken for one that did not run. */
#define TEST_NOT_RUN (-1)

/* A suite file defines `const test_case_t suite_<name>[]` ending in {NULL, NULL}. */
#define TEST_END {NULL, NULL}
extern const test_case_t suite_validation[], suite_grad[], suite_numerics[], suite_determinism[],
    suite_edge[], suite_fuzz[], suite_gpu[], suite_gpu_comm[];

extern uint64_t test_seed; /* printed by the runner; every case derives its inputs from it */

#define TEST_FAIL(...)                                         \
  do {                                                         \
    fprintf(stdout, "    %s:%d: ", __FILE__, __LINE__);        \
    fprintf(stdout, __VA_ARGS__);                              \
    fprintf(stdout, "\n");                                     \
    return 1;                                                  \
  } while (0)
#define TEST_ASSERT(cond, ...)      \
  do {                              \
    if (!(cond)) TEST_FAIL(__VA_ARGS__); \
  } while (0)

/* ---- helpers (runner.c, reference.c) ---- */
#include "problem.h"

extern const char* test_current; /* "suite.case" of the running case */
uint64_t test_case_seed(void);   /* test_seed mixed with the running case's name */
uint64_t test_next(uint64_t* state); /* splitmix64 */
uint16_t test_bf16(float f);         /* round to nearest even (finite f) */

/* Everything below that allocates is freed (contexts and comms destroyed) by the runner
 * after the case, also when the case fails early. */
void* test_alloc(size_t bytes); /* zeroed, 256-byte aligned, size rounded up to 256 */
mok_problem_t* test_problem(const mok_config_t* cfg, int64_t T_global, uint64_t seed);
mok_context_t* test_context(const mok_config_t* cfg, mok_status_t* status); /* NULL on failure */
void test_context_destroy(mok_context_t* ctx); /* destroys now and forgets it */
mok_cpu_comm_t* test_comm(int num_ranks);

/* Runs p; on failure prints the status and the first failing rank's message. */
mok_status_t test_run(mok_problem_t* p, const mok_run_opts_t* opts);

/* A copy of a run's outputs (mok_problem_outputs), kept until the end of the case. */
typedef struct {
  int n;
  mok_tensor_view_t v[MOK_PROBLEM_MAX_OUTPUTS];
} test_outputs_t;
void test_snapshot(const mok_problem_t* p, int with_backward, test_outputs_t* out);
const mok_tensor_view_t* test_view(const test_outputs_t* s, const char* name); /* or NULL */
/* Byte-compares the tensors named in `names` (space-separated; NULL = all of b) of a
 * against b; prints the tensor, first differing index and both values for each that
 * differs, prefixed by `what`. Returns how many differ. */
int test_same_bits(const test_outputs_t* a, const test_outputs_t* b, const char* names,
                   const char* what);
/* Relative error (mok_relative_error) of every tensor in `names` of a against b; prints
 * those above tol. Returns how many are above it. */
int test_close(const test_outputs_t* a, const test_outputs_t* b, const char* names, double tol,
               const char* what);

/* reference.c: the layer's forward written again, plainly, in double from the design
 * brief (section 1), for an EXACT-numerics problem. Outputs: y [T, H], topk_idx [T, K],
 * topk_weight [T, K], tokens_per_expert [E], aux and z losses, and (when not NULL, fused
 * routing) the scores [T, E]. */
void test_reference_forward(const mok_problem_t* p, double* y, int32_t* topk_idx,
                            double* topk_weight, int32_t* tokens_per_expert, double* aux_loss,
                            double* z_loss, double* scores);
/* Compares an EXACT problem's last forward (W ranks, gathered) with the reference:
 * routing and counts equal, y, weights and losses to 1e-12 relative. Returns failures. */
int test_check_reference(const mok_problem_t* p);
/* Fused routing of a BF16 run (pb) and an EXACT run (pe) of one problem: in every slot
 * the two experts are the same or a near-tie, their selection keys (score + bias, from
 * the reference) within 1e-6, which fp32 and double scores may order differently. */
int test_same_routing_up_to_ties(const mok_problem_t* pb, const mok_problem_t* pe);

#endif

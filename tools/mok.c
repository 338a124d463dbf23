/* mok.c — the `mok` command: `mok info` (version, backends, CPU, GPUs), `mok check`
 * (determinism D1-D4 on the spot, and the CUDA backend against the CPU backend) and
 * `mok bench` (step time and FLOP/s on a named shape, plus the CPU GEMM alone). It
 * drives the library through the problem fixture of tools/problem.h: one random global
 * batch, run on W CPU ranks or on GPUs. A run that would need more host memory than is
 * available is refused before anything is allocated.
 *
 * Exit status: 0 all good, 1 a check or a run failed, 2 a usage error, or a backend or
 * a shape that cannot run here (no device, too little memory). */
#define _POSIX_C_SOURCE 200809L
#include <errno.h>
#include <limits.h>
#include <math.h>
#include <omp.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "cpu/gemm.h"
#include "mok.h"
#include "problem.h"

#ifdef MOK_HAVE_CUDA
#include <cuda_runtime_api.h>
#endif

#ifndef MOK_MAX_THREADS /* (mok.h from before the library bounded cfg.num_threads) */
#define MOK_MAX_THREADS 1024
#endif

#define MAX_RANK_LIST 8
#define MAX_VIEWS MOK_PROBLEM_MAX_OUTPUTS

/* ---- named shapes: tokens per rank, H, F, E, K (DESIGN section 7) ---- */

typedef struct {
  const char* name;
  int64_t T, H, F, E, K, Fs;
  int big; /* slow on the CPU backend: bench defaults to 1 step */
} shape_t;

static const shape_t kShapes[] = {
    {"tiny", 512, 256, 128, 8, 2, 0, 0},
    {"qwen3-30b-a3b", 16384, 2048, 768, 128, 8, 0, 1},
    {"gpt-oss-120b", 16384, 2880, 2880, 128, 4, 0, 1},
    {"mixtral-8x7b", 8192, 4096, 14336, 8, 2, 0, 1},
    {"deepseek-v3", 8192, 7168, 2048, 256, 8, 0, 1},
    {"kimi-k2", 8192, 7168, 2048, 384, 8, 0, 1},
    {"qwen3.5", 16384, 4096, 1024, 512, 10, 0, 1},
};
#define NUM_SHAPES ((int)(sizeof kShapes / sizeof kShapes[0]))

/* FLOPs of one forward over T tokens: experts 6*T*K*H*F, router 2*T*H*E, shared
 * expert 6*T*H*Fs. A training step counts 3 x forward. */
static double forward_flops(const shape_t* s, int64_t T) {
  return 6.0 * T * s->K * s->H * s->F + 2.0 * T * s->H * s->E + 6.0 * T * s->H * s->Fs;
}

/* ---- small helpers ---- */

static void usage(FILE* out) {
  fprintf(out,
          "usage: mok <command> [options]\n"
          "\n"
          "  info                      version, backends, CPU, OpenMP threads, GPUs\n"
          "  check [options]           determinism D1-D4 on a random problem; on cuda, the\n"
          "                            GPU against the CPU backend too\n"
          "      --backend cpu|cuda    backend (default cpu; cuda: a GPU per rank, all on\n"
          "                            GPU 0 where W is more than the GPUs: loopback)\n"
          "      --shape NAME          named shape (default tiny)\n"
          "      --ranks W1,W2,...     expert-parallel sizes to compare (default 1,2,4;\n"
          "                            cuda: 1, and 2 where two GPUs are)\n"
          "      --seed N              random inputs (default: fresh, printed)\n"
          "      --threads N           threads per rank, 0..%d (default cores / W, at least 1)\n"
          "      --gate-up keep|recompute  backward reads gate|up kept by forward (default),\n"
          "                            or computes it again (cfg.gate_up)\n"
          "      --saved keep|reuse    backward leaves saved as it is (default), or writes\n"
          "                            its scratch over it (cfg.saved_use)\n"
          "      layer options (check and bench; each off by default):\n"
          "      --routing default|deepseek-v3  the router: fused softmax top-K, normalised\n"
          "                            (default), or DeepSeek-V3's: sigmoid scores, bias_select,\n"
          "                            8 groups of which the best 4 by their top-2 sums, weights\n"
          "                            normalised and scaled by 2.5 (E a multiple of 8)\n"
          "      --n-group N --topk-group N  group-limited routing (cfg.n_group, topk_group)\n"
          "      --group-score top2|max  a group's score (cfg.group_score; default top2)\n"
          "      --router-bias on|off  router logit bias b_router (cfg.use_router_bias)\n"
          "      --expert-bias on|off  expert biases b13, b2 (cfg.use_expert_bias)\n"
          "      --swiglu-limit X      gpt-oss's clamped SwiGLU at limit X (7 there)\n"
          "      --swiglu-alpha X      ... and alpha X (default 1.702)\n"
          "      --shared-ffn N        a shared expert of ffn size N (cfg.Fs; default the shape's)\n"
          "      --shared-gate on|off  its per-token sigmoid gate w_sg (cfg.use_shared_gate)\n"
          "  bench [options]           time forward, backward and step; the CPU GEMM alone\n"
          "      --backend cpu|cuda    backend (default cpu)\n"
          "      --shape NAME          named shape (default tiny)\n"
          "      --ranks W             expert-parallel size (default 1)\n"
          "      --steps N             timed steps (cpu: 5, 1 for the model shapes; cuda: 20)\n"
          "      --threads N           threads per rank, 0..%d (default cores / W, at least 1)\n"
          "      --seed N              random inputs (default 1)\n"
          "      --gate-up keep|recompute  as for check\n"
          "      --saved keep|reuse    as for check\n"
          "      --routing, --n-group, ... the layer options, as for check\n"
          "      --json FILE           also write the figures as JSON (checked before the run)\n"
          "  help                      this text\n"
          "\n"
          "Shapes (tokens per rank, H, F, E, K); a run on W ranks has W x T tokens:\n",
          MOK_MAX_THREADS, MOK_MAX_THREADS);
  for (int i = 0; i < NUM_SHAPES; i++) {
    const shape_t* s = &kShapes[i];
    fprintf(out, "  %-14s T %-6lld H %-5lld F %-6lld E %-4lld K %lld\n", s->name,
            (long long)s->T, (long long)s->H, (long long)s->F, (long long)s->E,
            (long long)s->K);
  }
}

static int usage_error(const char* fmt, ...) __attribute__((format(printf, 1, 2)));
static int usage_error(const char* fmt, ...) {
  va_list ap;
  va_start(ap, fmt);
  fprintf(stderr, "mok: ");
  vfprintf(stderr, fmt, ap);
  fprintf(stderr, "\n(mok help for usage)\n");
  va_end(ap);
  return 2;
}

static double now_s(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

static int num_cores(void) {
  long n = sysconf(_SC_NPROCESSORS_ONLN);
  return n > 0 ? (int)n : 1;
}

/* "model name" of /proc/cpuinfo, or "unknown CPU". */
static void cpu_model(char* out, size_t len) {
  snprintf(out, len, "unknown CPU");
  FILE* f = fopen("/proc/cpuinfo", "r");
  if (!f) return;
  char line[512];
  while (fgets(line, sizeof line, f)) {
    if (strncmp(line, "model name", 10) != 0) continue;
    const char* v = strchr(line, ':');
    if (!v) break;
    v++;
    while (*v == ' ' || *v == '\t') v++;
    snprintf(out, len, "%s", v);
    out[strcspn(out, "\n")] = 0;
    for (char* c = out; *c; c++) /* keep it printable and JSON-safe */
      if (*c == '"' || *c == '\\' || (unsigned char)*c < 32) *c = ' ';
    break;
  }
  fclose(f);
}

/* s, the whole of it, as a decimal integer in lo..hi: an optional sign, then digits
 * (no space, no trailing character, no value past int64's range). */
static int parse_i64(const char* s, int64_t lo, int64_t hi, int64_t* out) {
  const char* digits = *s == '-' || *s == '+' ? s + 1 : s;
  if (*digits < '0' || *digits > '9') return 0;
  char* end;
  errno = 0;
  long long v = strtoll(s, &end, 10);
  if (errno == ERANGE || *end || v < lo || v > hi) return 0;
  *out = v;
  return 1;
}

/* --name's integer value in lo..hi (note: what the range means, or ""); else a usage
 * error (2) naming the option and its range. */
static int parse_int_option(const char* name, const char* value, int64_t lo, int64_t hi, const char* note,
                            int64_t* out) {
  if (parse_i64(value, lo, hi, out)) return 0;
  return usage_error("--%s needs an integer in %lld..%lld%s, not '%s'", name, (long long)lo, (long long)hi,
                     note, value);
}

/* --ranks of check: "1,2,4" -> {1, 2, 4}, each 1..64, at most MAX_RANK_LIST, no empty
 * item. Returns the count, or 0 after a usage error. */
static int parse_ranks(const char* s, int* ranks) {
  int n = 0;
  for (const char* p = s;; n++) {
    const size_t len = strcspn(p, ",");
    char item[32] = "";
    int64_t v = 0;
    if (len == 0 || n == MAX_RANK_LIST || len >= sizeof item ||
        (memcpy(item, p, len), !parse_i64(item, 1, 64, &v))) {
      char why[64];
      if (len == 0)
        snprintf(why, sizeof why, "item %d is empty", n + 1);
      else if (n == MAX_RANK_LIST)
        snprintf(why, sizeof why, "more than %d sizes", MAX_RANK_LIST);
      else
        snprintf(why, sizeof why, "'%.*s' is not an integer in 1..64", (int)(len < 20 ? len : 20), p);
      usage_error("--ranks needs a list like 1,2,4 (each 1..64, at most %d), not '%s': %s", MAX_RANK_LIST, s,
                  why);
      return 0;
    }
    ranks[n] = (int)v;
    if (!p[len]) return n + 1;
    p += len + 1;
  }
}

static const shape_t* find_shape(const char* name) {
  for (int i = 0; i < NUM_SHAPES; i++)
    if (strcmp(kShapes[i].name, name) == 0) return &kShapes[i];
  return NULL;
}

static int unknown_shape(const char* name) {
  fprintf(stderr, "mok: unknown shape '%s'; the shapes are:\n", name);
  for (int i = 0; i < NUM_SHAPES; i++) fprintf(stderr, "  %s\n", kShapes[i].name);
  return 2;
}

/* Options shared by check and bench. */
typedef struct {
  const char* backend;
  const char* shape;
  const char* ranks;
  const char* json;
  mok_gate_up_t gate_up;
  mok_saved_use_t saved_use;
  int64_t seed, steps, threads;
  int has_seed, has_steps, has_threads;
  /* the layer's router and expert variants (mok.h) */
  int deepseek_v3;                          /* --routing deepseek-v3 */
  int64_t n_group, topk_group, shared_ffn;
  int has_n_group, has_topk_group, has_shared_ffn;
  mok_group_score_t group_score;
  int router_bias, expert_bias, shared_gate;
  double swiglu_limit, swiglu_alpha;
  int has_swiglu_limit, has_swiglu_alpha;
} options_t;

/* The options of the layer that check and bench both take (parse_options' names). */
#define LAYER_OPTIONS \
  " routing n-group topk-group group-score router-bias expert-bias swiglu-limit swiglu-alpha shared-ffn shared-gate "

/* --name's value, the whole string a finite number; else a usage error (2). */
static int parse_double_option(const char* name, const char* value, double* out) {
  char* end;
  errno = 0;
  const double v = strtod(value, &end);
  if (!*value || *end || errno == ERANGE || !isfinite(v))
    return usage_error("--%s needs a finite number, not '%s'", name, value);
  *out = v;
  return 0;
}

/* --name's value, one of two words: *second = 1 for the second; else a usage error (2). */
static int either(const char* name, const char* value, const char* first, const char* second_word, int* second) {
  *second = strcmp(value, second_word) == 0;
  if (*second || strcmp(value, first) == 0) return 0;
  return usage_error("--%s needs %s or %s, not '%s'", name, first, second_word, value);
}

/* Parses --name value / --name=value; `allowed` lists the option names the command takes. */
static int parse_options(int argc, char** argv, const char* allowed, options_t* o) {
  for (int i = 0; i < argc; i++) {
    const char* arg = argv[i];
    if (strncmp(arg, "--", 2) != 0) return usage_error("unexpected argument '%s'", arg);
    char name[32];
    const char* value = NULL;
    const char* eq = strchr(arg, '=');
    size_t len = eq ? (size_t)(eq - arg) : strlen(arg);
    if (len - 2 >= sizeof name) return usage_error("unknown option '%s'", arg);
    memcpy(name, arg + 2, len - 2);
    name[len - 2] = 0;
    char key[40];
    snprintf(key, sizeof key, " %s ", name);
    if (!strstr(allowed, key)) return usage_error("unknown option '--%s'", name);
    if (eq)
      value = eq + 1;
    else if (i + 1 < argc)
      value = argv[++i];
    else
      return usage_error("option '--%s' needs a value", name);
    if (strcmp(name, "backend") == 0) {
      o->backend = value;
    } else if (strcmp(name, "shape") == 0) {
      o->shape = value;
    } else if (strcmp(name, "ranks") == 0) {
      o->ranks = value;
    } else if (strcmp(name, "json") == 0) {
      o->json = value;
    } else if (strcmp(name, "gate-up") == 0) {
      int second = 0;
      if (either(name, value, "keep", "recompute", &second)) return 2;
      o->gate_up = second ? MOK_GATE_UP_RECOMPUTE : MOK_GATE_UP_SAVE;
    } else if (strcmp(name, "saved") == 0) {
      int second = 0;
      if (either(name, value, "keep", "reuse", &second)) return 2;
      o->saved_use = second ? MOK_SAVED_REUSE : MOK_SAVED_KEEP;
    } else if (strcmp(name, "seed") == 0) {
      if (parse_int_option(name, value, 0, INT64_MAX, "", &o->seed)) return 2;
      o->has_seed = 1;
    } else if (strcmp(name, "steps") == 0) {
      if (parse_int_option(name, value, 1, 1000000, "", &o->steps)) return 2;
      o->has_steps = 1;
    } else if (strcmp(name, "routing") == 0) {
      if (either(name, value, "default", "deepseek-v3", &o->deepseek_v3)) return 2;
    } else if (strcmp(name, "n-group") == 0) {
      if (parse_int_option(name, value, 0, INT_MAX, " (0 = no groups)", &o->n_group)) return 2;
      o->has_n_group = 1;
    } else if (strcmp(name, "topk-group") == 0) {
      if (parse_int_option(name, value, 0, INT_MAX, "", &o->topk_group)) return 2;
      o->has_topk_group = 1;
    } else if (strcmp(name, "group-score") == 0) {
      int second = 0;
      if (either(name, value, "top2", "max", &second)) return 2;
      o->group_score = second ? MOK_GROUP_SCORE_MAX : MOK_GROUP_SCORE_TOP2;
    } else if (strcmp(name, "router-bias") == 0) {
      if (either(name, value, "off", "on", &o->router_bias)) return 2;
    } else if (strcmp(name, "expert-bias") == 0) {
      if (either(name, value, "off", "on", &o->expert_bias)) return 2;
    } else if (strcmp(name, "shared-gate") == 0) {
      if (either(name, value, "off", "on", &o->shared_gate)) return 2;
    } else if (strcmp(name, "shared-ffn") == 0) {
      if (parse_int_option(name, value, 0, INT32_MAX, " (0 = none)", &o->shared_ffn)) return 2;
      o->has_shared_ffn = 1;
    } else if (strcmp(name, "swiglu-limit") == 0) {
      if (parse_double_option(name, value, &o->swiglu_limit)) return 2;
      o->has_swiglu_limit = 1;
    } else if (strcmp(name, "swiglu-alpha") == 0) {
      if (parse_double_option(name, value, &o->swiglu_alpha)) return 2;
      o->has_swiglu_alpha = 1;
    } else if (strcmp(name, "threads") == 0) {
      if (parse_int_option(name, value, 0, MOK_MAX_THREADS,
                           " (0 = all cores; MOK_MAX_THREADS, the library's bound)", &o->threads))
        return 2;
      o->has_threads = 1;
    }
  }
  return 0;
}

typedef enum { BACKEND_CPU, BACKEND_CUDA } backend_t;

/* GPUs visible (0 without a CUDA backend). */
static int gpu_count(void) {
#ifdef MOK_HAVE_CUDA
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess) n = 0;
  return n;
#else
  return 0;
#endif
}

/* Runs the problem on the chosen backend (CUDA: a GPU per rank). */
static mok_status_t run_problem(backend_t b, mok_problem_t* p, const mok_run_opts_t* o,
                                char* err, size_t len) {
  return b == BACKEND_CUDA ? mok_problem_run_cuda(p, o, err, len)
                           : mok_problem_run(p, o, err, len);
}

#ifdef MOK_HAVE_CUDA
/* Asks the library whether its CUDA backend can run here: creates and destroys a small
 * context on it. On failure writes the library's message to msg. */
static mok_status_t cuda_probe(char* msg, size_t len) {
  mok_config_t cfg = MOK_CONFIG_INIT;
  cfg.T = 64, cfg.H = 64, cfg.F = 64, cfg.E = 8, cfg.K = 2;
  cfg.backend = MOK_BACKEND_CUDA;
  mok_context_t* ctx = NULL;
  mok_status_t s = mok_context_create(&cfg, &ctx);
  if (s)
    snprintf(msg, len, "%s", mok_last_create_error());
  else
    mok_context_destroy(ctx);
  return s;
}
#endif

/* The device the CUDA backend uses (the current one), e.g. "NVIDIA H200, 132 SMs". */
static void gpu_name(char* out, size_t len) {
  snprintf(out, len, "no GPU");
#ifdef MOK_HAVE_CUDA
  int dev = 0;
  struct cudaDeviceProp prop;
  if (cudaGetDevice(&dev) == cudaSuccess && cudaGetDeviceProperties(&prop, dev) == cudaSuccess)
    snprintf(out, len, "%.200s, %d SMs", prop.name, prop.multiProcessorCount);
#endif
}

/* Whether an NVIDIA driver is on this machine: its kernel module (/proc/driver/nvidia)
 * or a GPU's device file. Writes the device file's path to `missing`, to say what is not there. */
static int nvidia_driver_present(const char** missing) {
  *missing = "/dev/nvidia0";
  return access("/proc/driver/nvidia/version", F_OK) == 0 || access("/dev/nvidia0", F_OK) == 0;
}

/* Checks --backend (default cpu); prints what the command runs on. Returns 0, or the
 * exit status. */
static int resolve_backend(const options_t* o, const char* command, backend_t* b) {
  *b = BACKEND_CPU;
  if (!o->backend || strcmp(o->backend, "cpu") == 0) {
#ifdef MOK_HAVE_CUDA
    printf("mok %s: CPU backend%s\n", command, o->backend ? "" : " (--backend cuda for the GPU)");
#else
    printf("mok %s: CPU backend%s\n", command,
           o->backend ? "" : " (this build has no CUDA backend: built without nvcc)");
#endif
    return 0;
  }
  if (strcmp(o->backend, "cuda") != 0)
    return usage_error("unknown backend '%s' (cpu or cuda)", o->backend);
#ifdef MOK_HAVE_CUDA
  char msg[600] = "";
  mok_status_t s = cuda_probe(msg, sizeof msg);
  const char* missing;
  if (s && !nvidia_driver_present(&missing)) {
    fprintf(stderr, "mok: --backend cuda: no NVIDIA driver on this machine (no %s); the CPU backend "
            "serves: leave out --backend cuda\n", missing);
    return 2;
  }
  if (s) {
    fprintf(stderr, "mok: --backend cuda: %s\n  %s\n", mok_status_string(s), msg);
    return 2;
  }
  char name[256];
  gpu_name(name, sizeof name);
  printf("mok %s: CUDA backend, %s\n", command, name);
  *b = BACKEND_CUDA;
  return 0;
#else
  fprintf(stderr, "mok: --backend cuda: %s: this build has no CUDA backend (built without nvcc)\n",
          mok_status_string(MOK_STATUS_BACKEND_UNAVAILABLE));
  return 2;
#endif
}

/* The layer every command runs: fused softmax routing, normalised, both router losses;
 * o's layer options (--routing deepseek-v3 first, then the single ones over it), --gate-up
 * and --saved (said when not the default). The shape's Fs is --shared-ffn's where given. */
static mok_config_t layer_config(const shape_t* s, const options_t* o) {
  mok_config_t cfg = MOK_CONFIG_INIT;
  cfg.H = s->H;
  cfg.F = s->F;
  cfg.E = s->E;
  cfg.K = s->K;
  cfg.Fs = o->has_shared_ffn ? o->shared_ffn : s->Fs;
  cfg.routing = MOK_ROUTING_FUSED;
  cfg.score = MOK_SCORE_SOFTMAX;
  cfg.normalize = 1;
  cfg.aux_loss_coef = 1e-2f;
  cfg.z_loss_coef = 1e-3f;
  cfg.backend = MOK_BACKEND_CPU;
  if (o->deepseek_v3) { /* DeepSeek-V3's router (DESIGN.md section 7) */
    cfg.score = MOK_SCORE_SIGMOID;
    cfg.use_bias_select = 1;
    cfg.n_group = 8, cfg.topk_group = 4, cfg.group_score = MOK_GROUP_SCORE_TOP2;
    cfg.route_scale = 2.5f;
  }
  if (o->has_n_group) cfg.n_group = (int)o->n_group;
  if (o->has_topk_group) cfg.topk_group = (int)o->topk_group;
  if (o->group_score != MOK_GROUP_SCORE_TOP2) cfg.group_score = o->group_score;
  cfg.use_router_bias = o->router_bias;
  cfg.use_expert_bias = o->expert_bias;
  if (o->has_swiglu_limit || o->has_swiglu_alpha) {
    cfg.activation = MOK_ACTIVATION_SWIGLU_CLAMPED;
    cfg.swiglu_limit = (float)(o->has_swiglu_limit ? o->swiglu_limit : 0.0);
    cfg.swiglu_alpha = (float)(o->has_swiglu_alpha ? o->swiglu_alpha : 1.702);
  }
  cfg.use_shared_gate = o->shared_gate;
  cfg.gate_up = o->gate_up;
  if (cfg.gate_up == MOK_GATE_UP_RECOMPUTE) printf("gate|up: computed again in backward (--gate-up recompute)\n");
  cfg.saved_use = o->saved_use;
  if (cfg.saved_use == MOK_SAVED_REUSE) printf("saved: the backward's scratch goes over it (--saved reuse)\n");
  return cfg;
}

/* The layer's router and its experts in words, for the runs' headers. */
static void describe_layer(const mok_config_t* c, char* out, size_t len) {
  int n = snprintf(out, len, "routing: fused %s top-%lld%s", c->score == MOK_SCORE_SIGMOID ? "sigmoid" : "softmax",
                   (long long)c->K, c->use_bias_select ? ", bias_select" : "");
  if (c->n_group > 1)
    n += snprintf(out + n, len - (size_t)n, ", the best %d of %d groups by their %s", c->topk_group, c->n_group,
                  c->group_score == MOK_GROUP_SCORE_MAX ? "largest score" : "top-2 sums");
  if (c->use_router_bias) n += snprintf(out + n, len - (size_t)n, ", router logit bias");
  n += snprintf(out + n, len - (size_t)n, "%s", c->normalize ? ", normalised" : "");
  if (c->route_scale != 1.0f) n += snprintf(out + n, len - (size_t)n, ", scaled by %g", (double)c->route_scale);
  n += snprintf(out + n, len - (size_t)n, ", aux_loss_coef %g, z_loss_coef %g; experts: %s", (double)c->aux_loss_coef,
                (double)c->z_loss_coef, c->activation == MOK_ACTIVATION_SWIGLU_CLAMPED ? "clamped SwiGLU" : "SwiGLU");
  if (c->activation == MOK_ACTIVATION_SWIGLU_CLAMPED)
    n += snprintf(out + n, len - (size_t)n, " (limit %g, alpha %g)", (double)c->swiglu_limit, (double)c->swiglu_alpha);
  if (c->use_expert_bias) n += snprintf(out + n, len - (size_t)n, ", biases b13, b2");
  if (c->Fs > 0)
    snprintf(out + n, len - (size_t)n, ", a shared expert (Fs %lld%s)", (long long)c->Fs,
             c->use_shared_gate ? ", gated" : "");
}

/* The layer options' config, checked by the library itself (a context of one token on
 * the CPU backend): 0, or a usage error (2) with the library's message naming the field. */
static int check_layer(const mok_config_t* cfg) {
  mok_config_t c = *cfg;
  c.T = 1, c.W = 1, c.rank = 0, c.backend = MOK_BACKEND_CPU, c.capacity = 0, c.num_threads = 1;
  mok_context_t* ctx = NULL;
  const mok_status_t s = mok_context_create(&c, &ctx);
  if (!s) {
    mok_context_destroy(ctx);
    return 0;
  }
  return usage_error("the layer options give a layer mok refuses: %s: %s", mok_status_string(s),
                     mok_last_create_error());
}

/* A command's shape (--shape, its Fs --shared-ffn's where given) and layer (layer_config,
 * checked by check_layer): 0, or the exit status of a usage error. */
static int command_layer(const options_t* o, shape_t* shape, mok_config_t* cfg) {
  const shape_t* named = find_shape(o->shape ? o->shape : "tiny");
  if (!named) return unknown_shape(o->shape);
  *shape = *named;
  *cfg = layer_config(shape, o);
  shape->Fs = cfg->Fs;
  return check_layer(cfg);
}

/* "2 threads", "1 thread", "all cores" (0: the library default). */
static const char* threads_str(int n, char* out, size_t len) {
  if (n == 0)
    snprintf(out, len, "all cores");
  else
    snprintf(out, len, "%d thread%s", n, n == 1 ? "" : "s");
  return out;
}

static int default_threads(int W) {
  int t = num_cores() / W;
  return t > 0 ? t : 1;
}

/* ---- host memory: a run that cannot fit is refused before it allocates ---- */

/* Host memory a new run can take: MemAvailable of /proc/meminfo, else the free pages
 * (sysconf); *source says which. 0 when neither is known. */
static size_t available_bytes(const char** source) {
  *source = "MemAvailable in /proc/meminfo";
  FILE* f = fopen("/proc/meminfo", "r");
  if (f) {
    char line[256];
    unsigned long long kib;
    while (fgets(line, sizeof line, f))
      if (sscanf(line, "MemAvailable: %llu kB", &kib) == 1) {
        fclose(f);
        return (size_t)kib * 1024;
      }
    fclose(f);
  }
  *source = "free pages, sysconf";
  const long pages = sysconf(_SC_AVPHYS_PAGES), page = sysconf(_SC_PAGESIZE);
  return pages > 0 && page > 0 ? (size_t)pages * (size_t)page : 0;
}

/* Host bytes of the runs of a command, from the shape alone (shape_only) or with the
 * saved and workspace sizes the library reports for the runs' contexts. */
typedef struct {
  const mok_config_t* cfg;
  int64_t T_global;
  int shape_only;
  char err[600];
} need_t;

/* One CPU run on W ranks of `threads` each, beyond its problem. */
static mok_status_t run_need(need_t* n, int64_t T_global, int W, int threads, size_t* bytes) {
  mok_run_opts_t ro = MOK_RUN_OPTS_INIT;
  ro.W = W;
  ro.num_threads = threads;
  return mok_problem_run_bytes(n->cfg, T_global, &ro, n->shape_only, bytes, n->err, sizeof n->err);
}

/* 0 when `need` bytes fit in the available memory (or it is not known); else prints
 * one line naming the shape, the bytes needed and available, and returns 2. */
static int refuse_if_too_big(const shape_t* s, const char* ranks, int shape_only, size_t need) {
  const char* source;
  const size_t avail = available_bytes(&source);
  if (avail == 0 || need <= avail) return 0;
  const double gib = 1024.0 * 1024.0 * 1024.0;
  fflush(stdout);
  fprintf(stderr,
          "mok: not enough memory for shape %s (%s): the run needs %s%zu bytes (%.1f GiB) of host "
          "memory, %zu bytes (%.1f GiB) are available (%s); nothing was run\n",
          s->name, ranks, shape_only ? "at least " : "", need, (double)need / gib, avail,
          (double)avail / gib, source);
  return 2;
}

/* ---- mok info ---- */

static int cmd_info(void) {
  const int v = mok_version();
  char model[256];
  cpu_model(model, sizeof model);
  const char* missing;
  const int driver = nvidia_driver_present(&missing);
  printf("mok %d.%d.%d (library), built against mok.h %d.%d.%d\n", v / 10000, v / 100 % 100,
         v % 100, MOK_VERSION_MAJOR, MOK_VERSION_MINOR, MOK_VERSION_PATCH);
  printf("backends:\n");
  printf("  cpu     built, usable: the reference backend, C11 + OpenMP\n");
  int cuda_usable = 0;
#ifdef MOK_HAVE_CUDA
  char msg[600] = "";
  mok_status_t s = cuda_probe(msg, sizeof msg);
  cuda_usable = s == MOK_STATUS_SUCCESS;
  if (cuda_usable)
    printf("  cuda    built (sm_90a), usable: one GPU per context, a GPU per rank for W > 1\n");
  else if (!driver)
    printf("  cuda    built (sm_90a), not usable here: no NVIDIA driver on this machine (no %s)\n", missing);
  else
    printf("  cuda    built (sm_90a), not usable here: %s\n          %s\n", mok_status_string(s), msg);
#else
  printf("  cuda    not built: this mok was built without nvcc (NVCC= or no nvcc found)\n");
#endif
  printf("cpu:      %s, %d cores online\n", model, num_cores());
  const char* env = getenv("OMP_NUM_THREADS");
  printf("openmp:   %d threads (OMP_NUM_THREADS %s)\n", omp_get_max_threads(),
         env ? env : "not set");
#ifdef MOK_HAVE_CUDA
  int num_gpus = 0;
  cudaError_t ce = cudaGetDeviceCount(&num_gpus);
  if (ce != cudaSuccess) num_gpus = 0;
  if (ce != cudaSuccess && !driver)
    printf("gpus:     none: no NVIDIA driver on this machine (no %s)\n", missing);
  else if (ce != cudaSuccess)
    printf("gpus:     none visible (%s)\n", cudaGetErrorString(ce));
  else
    printf("gpus:     %d\n", num_gpus);
  for (int d = 0; d < num_gpus; d++) {
    struct cudaDeviceProp prop;
    if (cudaGetDeviceProperties(&prop, d) != cudaSuccess) continue;
    printf("  %d       %s, sm_%d%d, %d SMs, %.0f GiB\n", d, prop.name, prop.major, prop.minor,
           prop.multiProcessorCount, (double)prop.totalGlobalMem / (1024.0 * 1024.0 * 1024.0));
  }
  if (num_gpus > 1) { /* peer access: what mok's exchange over NVLink would need */
    printf("peers:   ");
    for (int i = 0; i < num_gpus; i++)
      for (int j = i + 1; j < num_gpus; j++) {
        int ok = 0;
        cudaDeviceCanAccessPeer(&ok, i, j);
        printf(" %d-%d %s", i, j, ok ? "yes" : "no");
      }
    printf("\n");
  }
  if (num_gpus > 0)
    printf("nccl:     W > 1 on GPUs: a rank per GPU, loaded when a context of W > 1 is created\n");
#else
  if (driver)
    printf("gpus:     an NVIDIA driver is here; a mok built with nvcc would run on its GPUs\n");
  else
    printf("gpus:     none: no NVIDIA driver on this machine (no %s)\n", missing);
#endif
  if (!cuda_usable)
    printf("here:     the CPU backend serves: mok check and mok bench run on it (--backend cpu, "
           "the default)\n");
  return v == MOK_VERSION_CODE ? 0 : 1;
}

/* ---- snapshots of a run's outputs, compared bitwise ---- */

typedef struct {
  int n;
  mok_tensor_view_t v[MAX_VIEWS];
} snapshot_t;

static void snapshot_free(snapshot_t* s) {
  for (int i = 0; i < s->n; i++) free((void*)s->v[i].data);
  s->n = 0;
}

static int snapshot_take(const mok_problem_t* p, int with_backward, snapshot_t* s) {
  mok_tensor_view_t views[MAX_VIEWS];
  int n = mok_problem_outputs(p, with_backward, views, MAX_VIEWS);
  s->n = 0;
  for (int i = 0; i < n; i++) {
    size_t bytes = (size_t)views[i].count * views[i].elem;
    void* copy = malloc(bytes ? bytes : 1);
    if (!copy) {
      snapshot_free(s);
      return 0;
    }
    memcpy(copy, views[i].data, bytes);
    s->v[s->n] = views[i];
    s->v[s->n++].data = copy;
  }
  return 1;
}

/* An element as its bits and its value, e.g. "0x3f80 (1)". */
static void format_element(const mok_tensor_view_t* v, int64_t i, char* out, size_t len) {
  const char* d = (const char*)v->data + i * v->elem;
  switch (v->kind) {
    case 0: {
      uint16_t b;
      memcpy(&b, d, 2);
      snprintf(out, len, "0x%04x (%.9g)", b, mok_view_get(v, i));
      break;
    }
    case 1: {
      uint32_t b;
      memcpy(&b, d, 4);
      snprintf(out, len, "0x%08x (%.9g)", b, mok_view_get(v, i));
      break;
    }
    case 2: snprintf(out, len, "%.17g", mok_view_get(v, i)); break;
    default: snprintf(out, len, "%d", (int)mok_view_get(v, i)); break;
  }
}

/* Compares every view of `got` with `want` by bytes; on the first difference writes
 * "tensor[i]: got vs want" to detail and returns 0. */
static int views_equal(const mok_tensor_view_t* got, const mok_tensor_view_t* want, int n,
                       char* detail, size_t len) {
  for (int i = 0; i < n; i++) {
    int64_t at = mok_first_difference(&got[i], &want[i]);
    if (at < 0) continue;
    if (got[i].count != want[i].count) {
      snprintf(detail, len, "%s: %lld elements vs %lld", want[i].name,
               (long long)got[i].count, (long long)want[i].count);
      return 0;
    }
    char a[64], b[64];
    format_element(&got[i], at, a, sizeof a);
    format_element(&want[i], at, b, sizeof b);
    snprintf(detail, len, "not bitwise identical: first difference %s[%lld]: %s vs %s", want[i].name,
             (long long)at, a, b);
    return 0;
  }
  return 1;
}

/* ---- mok check ---- */

typedef struct {
  int num_checks, num_failed, num_bitwise;
} tally_t;

#define BITWISE "bitwise identical"

/* One line: the label, dots, then ok_text (BITWISE for a comparison of every byte) or
 * FAILED and the detail below. */
static void report(tally_t* t, const char* label, int ok, const char* ok_text, const char* detail) {
  char padded[64];
  snprintf(padded, sizeof padded, "%s ", label);
  size_t n = strlen(padded);
  while (n < 52) padded[n++] = '.';
  padded[n] = 0;
  printf("%s %s\n", padded, ok ? ok_text : "FAILED");
  if (!ok && detail && *detail) printf("    %s\n", detail);
  fflush(stdout);
  t->num_checks++;
  t->num_failed += !ok;
  t->num_bitwise += strcmp(ok_text, BITWISE) == 0;
}

/* Runs p and keeps its outputs in *snap; on failure reports the label as FAILED with
 * the reason and returns 0. */
static int run_snapshot(tally_t* t, const char* label, backend_t b, mok_problem_t* p,
                        const mok_run_opts_t* o, snapshot_t* snap) {
  char err[600] = "";
  mok_status_t s = run_problem(b, p, o, err, sizeof err);
  if (s) {
    char detail[700];
    snprintf(detail, sizeof detail, "%s: %s", mok_status_string(s), err);
    report(t, label, 0, "ok", detail);
    return 0;
  }
  if (!snapshot_take(p, o->backward, snap)) {
    report(t, label, 0, "ok", "out of host memory");
    return 0;
  }
  return 1;
}

/* Runs p and compares all outputs with ref bitwise; one report line. */
static void check_run(tally_t* t, const char* label, backend_t b, mok_problem_t* p,
                      const mok_run_opts_t* o, const snapshot_t* ref) {
  snapshot_t cur;
  if (!run_snapshot(t, label, b, p, o, &cur)) return;
  char detail[256] = "";
  int ok = cur.n == ref->n && views_equal(cur.v, ref->v, ref->n, detail, sizeof detail);
  report(t, label, ok, BITWISE, detail);
  snapshot_free(&cur);
}

/* The CUDA backend against the CPU backend (DESIGN section 6): integers exactly, every
 * other output by ||got - want|| / ||want|| <= tol. Writes the worst error to *worst. */
static int views_close(const snapshot_t* got, const snapshot_t* want, double tol, double* worst,
                       char* detail, size_t len) {
  *worst = 0;
  if (got->n != want->n) {
    snprintf(detail, len, "%d outputs vs %d", got->n, want->n);
    return 0;
  }
  for (int i = 0; i < want->n; i++) {
    if (want->v[i].kind == 3) {
      if (!views_equal(&got->v[i], &want->v[i], 1, detail, len)) return 0;
      continue;
    }
    double e = mok_relative_error(&got->v[i], &want->v[i]);
    if (!(e <= tol)) {
      snprintf(detail, len, "%s: relative error %.3g above %.0e", want->v[i].name, e, tol);
      *worst = e;
      return 0;
    }
    if (e > *worst) *worst = e;
  }
  return 1;
}

/* Every output finite, and y, dx and the gradients not all zero: a layer that writes
 * nothing would pass the determinism checks. */
static int outputs_sane(const snapshot_t* s, char* detail, size_t len) {
  for (int i = 0; i < s->n; i++) {
    const mok_tensor_view_t* v = &s->v[i];
    int any_nonzero = 0;
    for (int64_t j = 0; j < v->count; j++) {
      double x = mok_view_get(v, j);
      if (!isfinite(x)) {
        char e[64];
        format_element(v, j, e, sizeof e);
        snprintf(detail, len, "%s[%lld] = %s", v->name, (long long)j, e);
        return 0;
      }
      any_nonzero |= x != 0;
    }
    int must_move = v->name[0] == 'y' || v->name[0] == 'd';
    if (must_move && !any_nonzero) {
      snprintf(detail, len, "%s is all zeros", v->name);
      return 0;
    }
  }
  return 1;
}

/* Host bytes at mok check's peak: the problem and the reference's outputs (and the CPU
 * oracle's, on cuda) all along, with the largest of a second copy of the outputs, a CPU
 * run at each W of the list (on cuda the oracle's alone, at W0; the GPU runs keep their
 * buffers on the devices) and D4's problem of 4 tokens with its run. */
static mok_status_t check_need(need_t* n, const int* ranks, int num_ranks, const options_t* o, int cuda,
                               size_t* bytes) {
  const size_t outputs = mok_problem_outputs_bytes(n->cfg, n->T_global, 1);
  size_t peak = outputs, run = 0;
  for (int i = 0; i < (cuda ? 1 : num_ranks); i++) {
    const int threads = o->has_threads ? (int)o->threads : default_threads(ranks[i]);
    mok_status_t s = run_need(n, n->T_global, ranks[i], threads, &run);
    if (s) return s;
    if (run > peak) peak = run;
  }
  const int64_t T4 = n->T_global < 4 ? n->T_global : 4;
  run = 0;
  if (!cuda) {
    const int threads = o->has_threads ? (int)o->threads : default_threads(ranks[0]);
    mok_status_t s = run_need(n, T4, ranks[0], threads, &run);
    if (s) return s;
  }
  const size_t d4 = mok_problem_host_bytes(n->cfg, T4) + run;
  if (d4 > peak) peak = d4;
  *bytes = mok_problem_host_bytes(n->cfg, n->T_global) + outputs * (cuda ? 2 : 1) + peak;
  return MOK_STATUS_SUCCESS;
}

static int cmd_check(int argc, char** argv) {
  options_t o = {0};
  int rc = parse_options(argc, argv, " backend shape ranks seed threads gate-up saved " LAYER_OPTIONS, &o);
  if (rc) return rc;
  shape_t layer_shape;
  mok_config_t cfg;
  if ((rc = command_layer(&o, &layer_shape, &cfg))) return rc;
  const shape_t* shape = &layer_shape;
  int ranks[MAX_RANK_LIST] = {1, 2, 4};
  int num_ranks = 3;
  if (o.ranks && !(num_ranks = parse_ranks(o.ranks, ranks))) return 2;
  backend_t backend;
  if ((rc = resolve_backend(&o, "check", &backend))) return rc;
  const int cuda = backend == BACKEND_CUDA;
  if (cuda && !o.ranks) num_ranks = gpu_count() >= 2 ? 2 : 1; /* W = 1, and 2 where two GPUs are */
  int W_max = 0;
  for (int i = 0; i < num_ranks; i++) {
    if (shape->E % ranks[i])
      return usage_error("W = %d does not divide E = %lld of shape %s", ranks[i],
                         (long long)shape->E, shape->name);
    if (ranks[i] > W_max) W_max = ranks[i];
  }
  uint64_t seed = o.has_seed ? (uint64_t)o.seed : (uint64_t)(now_s() * 1e6) % 1000000007u;

  /* the reference run: W0 ranks on the CPU, W = 1 on the GPU */
  const int W0 = ranks[0];
  const int64_t T_global = shape->T * W_max;
  const int threads = o.has_threads ? (int)o.threads : default_threads(W0);
  char tstr[24];
  printf("shape %s: H %lld, F %lld, E %lld, K %lld; %lld tokens in all (%lld x %d rank%s)\n",
         shape->name, (long long)shape->H, (long long)shape->F, (long long)shape->E,
         (long long)shape->K, (long long)T_global, (long long)shape->T, W_max,
         W_max > 1 ? "s" : "");
  char layer_words[512];
  describe_layer(&cfg, layer_words, sizeof layer_words);
  printf("%s; forward + backward\n", layer_words);
  if (cuda)
    printf("seed %llu (--seed %llu repeats it); W = %d on GPUs is the reference; CPU oracle (W = %d) on %s\n",
           (unsigned long long)seed, (unsigned long long)seed, W0, W0,
           threads_str(threads, tstr, sizeof tstr));
  else
    printf("seed %llu (--seed %llu repeats it); W = %d is the reference; %s per rank%s\n",
           (unsigned long long)seed, (unsigned long long)seed, W0,
           threads_str(threads, tstr, sizeof tstr), o.has_threads ? "" : " (cores / W)");
  fflush(stdout);

  mok_status_t s = MOK_STATUS_SUCCESS;
  for (int shape_only = 1; shape_only >= 0; shape_only--) { /* the shape first, then the contexts' sizes */
    need_t n = {&cfg, T_global, shape_only, ""};
    size_t need = 0;
    if ((s = check_need(&n, ranks, num_ranks, &o, cuda, &need))) {
      fprintf(stderr, "mok: cannot size the runs: %s: %s\n", mok_status_string(s), n.err);
      return 1;
    }
    char ranks_str[64];
    snprintf(ranks_str, sizeof ranks_str, "--ranks %s", o.ranks ? o.ranks : "1,2,4");
    if ((rc = refuse_if_too_big(shape, ranks_str, shape_only, need))) return rc;
  }
  if (shape->big)
    fprintf(stderr, "mok: warning: shape %s on the CPU backend is slow (%.0f GFLOP per step)\n",
            shape->name, 3.0 * forward_flops(shape, T_global) * 1e-9);

  mok_problem_t* p = NULL;
  s = mok_problem_create(&cfg, T_global, seed, &p);
  if (s) {
    fprintf(stderr, "mok: cannot create the problem: %s\n", mok_status_string(s));
    return 1;
  }
  tally_t tally = {0, 0, 0};
  char label[64], err[600] = "", detail[700] = "";
  snapshot_t ref = {0}, oracle = {0};
  mok_run_opts_t ref_opts = MOK_RUN_OPTS_INIT;
  ref_opts.W = W0;
  ref_opts.num_threads = threads;

  /* the GPU is checked against the CPU backend first */
  if (cuda && !run_snapshot(&tally, "CPU oracle run", BACKEND_CPU, p, &ref_opts, &oracle)) goto done;

  /* the reference: 3 steps */
  ref_opts.steps = 3;
  if (!run_snapshot(&tally, "reference run", backend, p, &ref_opts, &ref)) goto done;
  int sane = outputs_sane(&ref, detail, sizeof detail);
  report(&tally, "outputs finite, y and gradients non-zero", sane, "ok", detail);
  if (cuda) {
    double worst;
    detail[0] = 0;
    int ok = views_close(&ref, &oracle, 1e-2, &worst, detail, sizeof detail);
    snprintf(label, sizeof label, "CUDA vs CPU (worst relative error %.1e)", worst);
    report(&tally, label, ok, "within 1e-2", detail);
  }
  printf("D1-D3 compare every output (y, dx, weight gradients, routing, losses) bit for bit, D4 y:\n");

  /* D1: the same run again, and 1 step against 3 */
  check_run(&tally, "D1 run-to-run (2 runs, 3 steps)", backend, p, &ref_opts, &ref);
  mok_run_opts_t one = ref_opts;
  one.steps = 1;
  check_run(&tally, "D1 step-to-step (1 step vs 3 steps)", backend, p, &one, &ref);

  /* D2: the thread count (CPU) or the grid size (GPU) does not change a bit */
  {
    mok_run_opts_t other = one;
    if (cuda) {
      other.num_ctas = 17;
      snprintf(label, sizeof label, "D2 grid (17 CTAs vs one per SM)");
    } else {
      other.num_threads = threads == 1 ? 2 : 1;
      char a[24], b[24];
      snprintf(label, sizeof label, "D2 threads (%s vs %s per rank)",
               threads_str(other.num_threads, a, sizeof a), threads_str(threads, b, sizeof b));
    }
    check_run(&tally, label, backend, p, &other, &ref);
  }
  /* and the GPU's CTAs in clusters of 2 sharing weight tiles, or each alone */
  if (cuda) {
    mok_run_opts_t on = one, off = one;
    on.cta_pairs = MOK_CTA_PAIRS_ON;
    off.cta_pairs = MOK_CTA_PAIRS_OFF;
    check_run(&tally, "D2 CTA pairs on (vs the default)", backend, p, &on, &ref);
    check_run(&tally, "D2 CTA pairs off (vs the default)", backend, p, &off, &ref);
  }

  /* D3: the same global batch on every W of the list (CUDA: a GPU per rank) */
  for (int i = 1; i < num_ranks; i++) {
    mok_run_opts_t w = one;
    w.W = ranks[i];
    w.num_threads = o.has_threads ? (int)o.threads : default_threads(ranks[i]);
    snprintf(label, sizeof label, "D3 W=%d vs W=%d (all outputs%s)", ranks[i], W0,
             cuda && ranks[i] > gpu_count() ? "; the ranks share GPU 0: loopback" : "");
    check_run(&tally, label, backend, p, &w, &ref);
  }

  /* D4: the first 4 tokens alone give the bits they had in the batch */
  {
    const int64_t T4 = T_global < 4 ? T_global : 4;
    mok_problem_t* p4 = NULL;
    snprintf(label, sizeof label, "D4 first %lld tokens alone vs in batch (y)", (long long)T4);
    s = mok_problem_create(&cfg, T4, seed, &p4);
    if (s) {
      report(&tally, label, 0, BITWISE, mok_status_string(s));
      goto done;
    }
    memcpy(p4->x, p->x, (size_t)(T4 * cfg.H) * p->act);
    mok_problem_copy_weights(p4, p); /* (the variants' tensors too) */
    mok_run_opts_t fwd = one;
    fwd.backward = 0;
    s = run_problem(backend, p4, &fwd, err, sizeof err);
    if (s) {
      snprintf(detail, sizeof detail, "%s: %s", mok_status_string(s), err);
      report(&tally, label, 0, BITWISE, detail);
    } else {
      mok_tensor_view_t got[MAX_VIEWS];
      mok_problem_outputs(p4, 0, got, MAX_VIEWS); /* views[0] is y */
      mok_tensor_view_t want = ref.v[0];
      want.count = got[0].count;
      detail[0] = 0;
      int ok = views_equal(&got[0], &want, 1, detail, sizeof detail);
      report(&tally, label, ok, BITWISE, detail);
    }
    mok_problem_destroy(p4);
  }

done:
  snapshot_free(&ref);
  snapshot_free(&oracle);
  mok_problem_destroy(p);
  if (tally.num_failed)
    printf("%d of %d checks FAILED (seed %llu)\n", tally.num_failed, tally.num_checks,
           (unsigned long long)seed);
  else
    printf("all %d checks ok (%d bitwise comparisons)\n", tally.num_checks, tally.num_bitwise);
  return tally.num_failed ? 1 : 0;
}

/* ---- mok bench ---- */

static int cmp_double(const void* a, const void* b) {
  double x = *(const double*)a, y = *(const double*)b;
  return (x > y) - (x < y);
}
static double median(double* v, int n) {
  qsort(v, (size_t)n, sizeof *v, cmp_double);
  return n % 2 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
}

typedef struct {
  int64_t M, N, K;
  int threads, reps;
  double ms, gflops;
} gemm_result_t;

/* The CPU backend's GEMM alone: C[M, N] fp32 = A[M, K] . B[N, K]^T in bf16, the layout
 * of x . W^T; median of `reps` calls after one warm-up, all threads. */
static int bench_gemm(gemm_result_t* g) {
  const int64_t M = g->M, N = g->N, K = g->K;
  uint16_t* A = aligned_alloc(256, (size_t)(M * K) * 2);
  uint16_t* B = aligned_alloc(256, (size_t)(N * K) * 2);
  float* C = aligned_alloc(256, (size_t)(M * N) * 4);
  void* pack = aligned_alloc(256, (size_t)g->threads * mok_gemm_pack_bytes() / 256 * 256 + 256);
  double* times = malloc((size_t)g->reps * sizeof *times);
  int ok = A && B && C && pack && times;
  if (ok) {
    uint64_t s = 0x9e3779b97f4a7c15ull;
    for (int64_t i = 0; i < M * K + N * K; i++) { /* bf16 values in (-1, 1) */
      s = s * 6364136223846793005ull + 1442695040888963407ull;
      float f = (float)((double)(s >> 11) * 0x1.0p-53 * 2.0 - 1.0);
      uint32_t u;
      memcpy(&u, &f, 4);
      (i < M * K ? A : B)[i < M * K ? i : i - M * K] = (uint16_t)(u >> 16);
    }
    mok_gemm_t p = {M, N, K, A, K, 1, B, 1, K, C, N};
    mok_gemm_bf16(&p, pack, g->threads);
    for (int r = 0; r < g->reps; r++) {
      double t0 = now_s();
      mok_gemm_bf16(&p, pack, g->threads);
      times[r] = now_s() - t0;
    }
    double t = median(times, g->reps);
    g->ms = 1e3 * t;
    g->gflops = 2.0 * M * N * K / t * 1e-9;
  }
  free(A);
  free(B);
  free(C);
  free(pack);
  free(times);
  return ok;
}

/* --json's file, opened before the run so that a path that cannot be written fails at
 * once; for appending, so that a file already there keeps its contents until the
 * figures replace them. *created: no file was there. */
static FILE* json_open(const char* path, int* created) {
  *created = access(path, F_OK) != 0;
  return fopen(path, "a");
}

static int cmd_bench(int argc, char** argv) {
  options_t o = {0};
  int rc = parse_options(argc, argv, " backend shape ranks steps threads seed json gate-up saved " LAYER_OPTIONS, &o);
  if (rc) return rc;
  shape_t layer_shape;
  mok_config_t cfg;
  if ((rc = command_layer(&o, &layer_shape, &cfg))) return rc;
  const shape_t* shape = &layer_shape;
  int64_t W = 1;
  if (o.ranks && parse_int_option("ranks", o.ranks, 1, 64, " (one expert-parallel size)", &W)) return 2;
  if (shape->E % W)
    return usage_error("W = %lld does not divide E = %lld of shape %s", (long long)W,
                       (long long)shape->E, shape->name);
  backend_t backend;
  if ((rc = resolve_backend(&o, "bench", &backend))) return rc;
  const int cuda = backend == BACKEND_CUDA;
  if (cuda && W > gpu_count()) {
    fprintf(stderr, "mok: --ranks %lld: the CUDA backend runs a rank per GPU, and %d are visible\n",
            (long long)W, gpu_count());
    return 2;
  }
  int json_created = 0;
  FILE* json = o.json ? json_open(o.json, &json_created) : NULL;
  if (o.json && !json) {
    fprintf(stderr, "mok: --json %s: cannot write it: %s\n", o.json, strerror(errno));
    return 2;
  }
  mok_problem_t* p = NULL;
  double *fwd = NULL, *bwd = NULL, *step = NULL;
  /* CPU: 5 steps, 1 for the model shapes (minutes each); GPU: 20, as bench/ does */
  const int steps = o.has_steps ? (int)o.steps : cuda ? 20 : shape->big ? 1 : 5;
  const int threads = o.has_threads ? (int)o.threads : default_threads((int)W);
  const uint64_t seed = o.has_seed ? (uint64_t)o.seed : 1;
  const int64_t T_global = shape->T * W;
  const double step_flops = 3.0 * forward_flops(shape, T_global);
  /* FLOP/s in GFLOP/s on the CPU, TFLOP/s on the GPU */
  const double unit = cuda ? 1e-12 : 1e-9;
  const char* unit_name = cuda ? "TFLOP/s" : "GFLOP/s";
  char device[256], tstr[24];
  if (cuda)
    gpu_name(device, sizeof device);
  else
    cpu_model(device, sizeof device);
  printf("shape %s: H %lld, F %lld, E %lld, K %lld; W %lld, %lld tokens per rank (%lld in all)\n",
         shape->name, (long long)shape->H, (long long)shape->F, (long long)shape->E,
         (long long)shape->K, (long long)W, (long long)shape->T, (long long)T_global);
  if (cuda)
    printf("%s; CUDA events; seed %llu\n", device, (unsigned long long)seed);
  else
    printf("%s, %d cores; %s per rank%s; seed %llu\n", device, num_cores(),
           threads_str(threads, tstr, sizeof tstr), o.has_threads ? "" : " (cores / W)",
           (unsigned long long)seed);
  printf("%d timed step%s, each a fresh run: a warm-up step, then the timed step; median\n",
         steps, steps > 1 ? "s" : "");
  char layer_words[512];
  describe_layer(&cfg, layer_words, sizeof layer_words);
  printf("%s\n", layer_words);
  fflush(stdout);

  /* host memory: the problem, and on the CPU a run of W ranks; from the shape first, then
   * with the saved and workspace sizes of the run's contexts */
  mok_status_t s = MOK_STATUS_SUCCESS;
  char ranks_str[32];
  snprintf(ranks_str, sizeof ranks_str, "W = %lld", (long long)W);
  for (int shape_only = 1; shape_only >= 0; shape_only--) {
    need_t n = {&cfg, T_global, shape_only, ""};
    size_t run = 0;
    if (!cuda && (s = run_need(&n, T_global, (int)W, threads, &run))) {
      fprintf(stderr, "mok: cannot size the run: %s: %s\n", mok_status_string(s), n.err);
      rc = 1;
      goto done;
    }
    if ((rc = refuse_if_too_big(shape, ranks_str, shape_only, mok_problem_host_bytes(&cfg, T_global) + run)))
      goto done;
    if (cuda) break;
  }
  if (shape->big && !cuda)
    fprintf(stderr,
            "mok: warning: shape %s on the CPU backend is slow (%.0f GFLOP per step); "
            "%d step%s after warm-up%s\n",
            shape->name, step_flops * 1e-9, steps, steps > 1 ? "s" : "",
            o.has_steps ? "" : " (--steps N for more)");

  s = mok_problem_create(&cfg, T_global, seed, &p);
  if (s) {
    fprintf(stderr, "mok: cannot create the problem: %s\n", mok_status_string(s));
    rc = 1;
    goto done;
  }
  fwd = malloc((size_t)steps * sizeof *fwd);
  bwd = malloc((size_t)steps * sizeof *bwd);
  step = malloc((size_t)steps * sizeof *step);
  if (!fwd || !bwd || !step) {
    fprintf(stderr, "mok: out of host memory\n");
    rc = 1;
    goto done;
  }
  mok_run_opts_t ro = MOK_RUN_OPTS_INIT;
  ro.W = (int)W;
  ro.steps = 2; /* warm-up + the timed step: the fixture times a run's last step */
  ro.num_threads = threads;
  for (int i = 0; i < steps; i++) {
    char err[600] = "";
    s = run_problem(backend, p, &ro, err, sizeof err);
    if (s) {
      fprintf(stderr, "mok: run failed: %s: %s\n", mok_status_string(s), err);
      rc = 1;
      goto done;
    }
    fwd[i] = p->seconds_forward;
    bwd[i] = p->seconds_backward;
    step[i] = fwd[i] + bwd[i];
  }
  const double fwd_ms = 1e3 * median(fwd, steps), bwd_ms = 1e3 * median(bwd, steps);
  const double step_ms = 1e3 * median(step, steps);
  const double rate = step_flops / (step_ms * 1e-3) * unit;
  printf("%-10s %10s %10s\n", "", "ms", unit_name);
  printf("%-10s %10.3f %10.1f\n", "forward", fwd_ms, step_flops / 3.0 / (fwd_ms * 1e-3) * unit);
  printf("%-10s %10.3f %10.1f\n", "backward", bwd_ms,
         2.0 * step_flops / 3.0 / (bwd_ms * 1e-3) * unit);
  printf("%-10s %10.3f %10.1f   (%.3f GFLOP: 3 x forward)\n", "step", step_ms, rate,
         step_flops * 1e-9);
  fflush(stdout);

  gemm_result_t g = {1024, 1536, 2048, omp_get_max_threads(), 5, 0, 0};
  if (!cuda) {
    if (!bench_gemm(&g)) {
      fprintf(stderr, "mok: out of host memory for the GEMM benchmark\n");
      rc = 1;
      goto done;
    }
    printf("gemm       %10.3f %10.1f   (bf16 %lldx%lldx%lld -> fp32, %d threads, median of %d)\n",
           g.ms, g.gflops, (long long)g.M, (long long)g.N, (long long)g.K, g.threads, g.reps);
  }

  if (json) {
    FILE* f = json;
    json = NULL; /* closed here, whatever happens */
    if (ftruncate(fileno(f), 0) != 0) {
      fprintf(stderr, "mok: cannot write %s: %s\n", o.json, strerror(errno));
      fclose(f);
      rc = 1;
      goto done;
    }
    const int v = mok_version();
    fprintf(f,
            "{\n  \"version\": \"%d.%d.%d\",\n  \"backend\": \"%s\",\n  \"device\": \"%s\",\n"
            "  \"cores\": %d,\n  \"shape\": {\"name\": \"%s\", \"T_per_rank\": %lld, "
            "\"H\": %lld, \"F\": %lld, \"E\": %lld, \"K\": %lld, \"Fs\": %lld},\n"
            "  \"W\": %lld,\n  \"T_global\": %lld,\n  \"threads_per_rank\": %d,\n"
            "  \"seed\": %llu,\n  \"steps\": %d,\n  \"forward_ms\": %.4f,\n"
            "  \"backward_ms\": %.4f,\n  \"step_ms\": %.4f,\n  \"step_gflop\": %.6f,\n"
            "  \"step_gflops\": %.3f,\n"
            "  \"layer\": {\"score\": \"%s\", \"route_scale\": %g, \"bias_select\": %d, \"n_group\": %d, "
            "\"topk_group\": %d, \"group_score\": \"%s\", \"router_bias\": %d, \"expert_bias\": %d, "
            "\"swiglu_limit\": %g, \"swiglu_alpha\": %g, \"shared_gate\": %d},\n",
            v / 10000, v / 100 % 100, v % 100, cuda ? "cuda" : "cpu", device, num_cores(),
            shape->name, (long long)shape->T, (long long)shape->H, (long long)shape->F,
            (long long)shape->E, (long long)shape->K, (long long)shape->Fs, (long long)W,
            (long long)T_global, cuda ? 0 : threads, (unsigned long long)seed, steps, fwd_ms,
            bwd_ms, step_ms, step_flops * 1e-9, step_flops / (step_ms * 1e-3) * 1e-9,
            cfg.score == MOK_SCORE_SIGMOID ? "sigmoid" : "softmax", (double)cfg.route_scale, cfg.use_bias_select,
            cfg.n_group, cfg.topk_group, cfg.group_score == MOK_GROUP_SCORE_MAX ? "max" : "top2", cfg.use_router_bias,
            cfg.use_expert_bias, (double)cfg.swiglu_limit, (double)cfg.swiglu_alpha, cfg.use_shared_gate);
    if (cuda)
      fprintf(f, "  \"gemm\": null\n}\n");
    else
      fprintf(f,
              "  \"gemm\": {\"M\": %lld, \"N\": %lld, \"K\": %lld, \"threads\": %d, "
              "\"ms\": %.4f, \"gflops\": %.3f}\n}\n",
              (long long)g.M, (long long)g.N, (long long)g.K, g.threads, g.ms, g.gflops);
    if (fclose(f) != 0) {
      fprintf(stderr, "mok: cannot write %s\n", o.json);
      rc = 1;
      goto done;
    }
    printf("wrote %s\n", o.json);
  }

done:
  if (json) { /* the run failed: nothing written, and no file left where there was none */
    fclose(json);
    if (json_created) remove(o.json);
  }
  free(fwd);
  free(bwd);
  free(step);
  mok_problem_destroy(p);
  return rc;
}

int main(int argc, char** argv) {
  /* CUDA runs of more ranks than GPUs put every rank on GPU 0 (a loopback id), which
   * needs a hardware queue per rank's stream (mok.h): before the first CUDA call */
  setenv("CUDA_DEVICE_MAX_CONNECTIONS", "32", 0);
  if (argc < 2) {
    usage(stderr);
    return 2;
  }
  if (strcmp(argv[1], "help") == 0 || strcmp(argv[1], "--help") == 0 ||
      strcmp(argv[1], "-h") == 0) {
    usage(stdout);
    return 0;
  }
  const char* cmd = argv[1];
  if (strcmp(cmd, "info") == 0) {
    if (argc > 2) return usage_error("info takes no options");
    return cmd_info();
  }
  if (strcmp(cmd, "check") == 0) return cmd_check(argc - 2, argv + 2);
  if (strcmp(cmd, "bench") == 0) return cmd_bench(argc - 2, argv + 2);
  return usage_error("unknown command '%s'", cmd);
}

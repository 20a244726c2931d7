/* One AdamW step that reads and writes every operand once, in its stored dtype.
 *
 * torch's CPU `_fused_adamw_` takes one dtype per call, so a BF16 gradient or BF16
 * moments cost the eager engine separate widening and narrowing passes. This loop
 * widens, updates and narrows in registers. Its arithmetic is, operation for operation,
 * the FP32 arithmetic of torch's CPU fused AdamW (the same roundings, the same fused
 * multiply-adds, and the scalar form torch uses for the last `n % 8` elements of a
 * tensor), followed by round-to-nearest-even narrowing: bitwise the eager engine.
 * `native_kernel.py` builds it with -ffp-contract=off so the compiler adds no
 * contraction of its own, and checks it against the eager engine before first use.
 * Work is shared over OpenMP threads: linked as libgomp.so.1, the library binds to the
 * runtime torch has already loaded, so it uses torch's thread pool and thread count.
 */
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <string.h>

typedef struct {
  float decay;         /* 1 - lr * weight_decay */
  float lerp_weight;   /* 1 - beta1 */
  float beta2;
  float sq_weight;     /* 1 - beta2 */
  float bc2_sqrt;      /* sqrt(1 - beta2 ** step) */
  float eps;
  float neg_step_size; /* -lr / (1 - beta1 ** step) */
  float grad_sign;     /* -1 with maximize, else 1 */
} veoptim_adamw_hyper;

static inline float widen(uint16_t b) {
  uint32_t u = (uint32_t)b << 16;
  float f;
  memcpy(&f, &u, sizeof f);
  return f;
}

static inline uint16_t narrow(float f) { /* round to nearest even; NaN stays NaN */
  uint32_t u;
  memcpy(&u, &f, sizeof u);
  if (f != f) return 0x7FC0;
  return (uint16_t)((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
}

enum { OUT_NONE = 0, OUT_BF16 = 1, OUT_F32 = 2 };

#define LOAD(ptr, bf16, d) ((bf16) ? widen(((const uint16_t *)(ptr))[d]) : ((const float *)(ptr))[d])
#define STORE(ptr, bf16, d, x)                                  \
  do {                                                          \
    if (bf16) ((uint16_t *)(ptr))[d] = narrow(x);               \
    else ((float *)(ptr))[d] = (x);                             \
  } while (0)

/* The flags are compile-time constants at every call site below, so each combination is
 * its own vectorised loop. `tail` is the scalar form of torch's kernel: there the second
 * moment's multiply-add is contracted the other way round. */
static inline __attribute__((always_inline)) void update(
    int64_t begin, int64_t end, int tail, float *restrict master, const void *restrict grad,
    void *restrict exp_avg, void *restrict exp_avg_sq, void *restrict out,
    const veoptim_adamw_hyper *h, const int grad_bf16, const int moments_bf16,
    const int out_kind, const int lerp_small) {
  const float decay = h->decay, w = h->lerp_weight, w1 = h->lerp_weight - 1.0f;
  const float beta2 = h->beta2, sq_w = h->sq_weight, bc2 = h->bc2_sqrt, eps = h->eps;
  const float nss = h->neg_step_size, sign = h->grad_sign;
  for (int64_t d = begin; d < end; d++) {
    const float g = LOAD(grad, grad_bf16, d) * sign;
    const float p = master[d] * decay;
    const float m0 = LOAD(exp_avg, moments_bf16, d);
    const float v0 = LOAD(exp_avg_sq, moments_bf16, d);
    const float m = lerp_small ? fmaf(w, g - m0, m0) : fmaf(w1, g - m0, g);
    const float v = tail ? fmaf(v0, beta2, (sq_w * g) * g) : fmaf(sq_w * g, g, v0 * beta2);
    const float x = p + (nss * m) / (sqrtf(v) / bc2 + eps);
    STORE(exp_avg, moments_bf16, d, m);
    STORE(exp_avg_sq, moments_bf16, d, v);
    master[d] = x;
    if (out_kind == OUT_BF16) ((uint16_t *)out)[d] = narrow(x);
    if (out_kind == OUT_F32) ((float *)out)[d] = x;
  }
}

#define CASE(G, M, O, L)                                                                     \
  case ((G) << 4 | (M) << 3 | (O) << 1 | (L)):                                               \
    update(begin, body, 0, master, grad, exp_avg, exp_avg_sq, out, h, G, M, O, L);            \
    update(body, end, 1, master, grad, exp_avg, exp_avg_sq, out, h, G, M, O, L);              \
    break;
#define CASES_L(G, M, O) CASE(G, M, O, 0) CASE(G, M, O, 1)
#define CASES_O(G, M) CASES_L(G, M, OUT_NONE) CASES_L(G, M, OUT_BF16) CASES_L(G, M, OUT_F32)
#define CASES_M(G) CASES_O(G, 0) CASES_O(G, 1)

/* Elements [begin, end) of one tensor of `numel` elements. `begin` must be a multiple of
 * 16 (torch's kernel splits work at 64-byte units); the elements past the last multiple of
 * 8 of the tensor take the scalar form. `out` is the parameter written from the master
 * (`out_kind`: 0 none, 1 BF16, 2 FP32). */
static void update_range(int64_t numel, int64_t begin, int64_t end, float *master,
                         const void *grad, int grad_bf16, void *exp_avg, void *exp_avg_sq,
                         int moments_bf16, void *out, int out_kind, const veoptim_adamw_hyper *h) {
  /* torch's kernel: 16-wide vectors, then its compiled tail loop runs 8 elements at a time
   * with the same contraction, and the last numel % 8 one by one with the other. */
  const int64_t vector_end = numel - numel % 8;
  const int64_t body = end < vector_end ? end : (begin > vector_end ? begin : vector_end);
  const int lerp_small = fabsf(h->lerp_weight) < 0.5f;
  if (out_kind < OUT_NONE || out_kind > OUT_F32) return;
  switch ((grad_bf16 != 0) << 4 | (moments_bf16 != 0) << 3 | out_kind << 1 | lerp_small) {
    CASES_M(0)
    CASES_M(1)
  }
}

typedef struct {
  int64_t numel;
  float *master;
  const void *grad;
  void *exp_avg;
  void *exp_avg_sq;
  void *out;
  int32_t grad_bf16, moments_bf16, out_kind; /* both moments have one dtype */
  const veoptim_adamw_hyper *hyper;
} veoptim_adamw_tensor;

/* Every tensor of `tensors`, the elements shared out over the OpenMP threads in ranges of
 * about equal size (one thread below `min_parallel` elements). Each tensor starts at a
 * multiple of 64 of the virtual concatenation, so every cut is 64-aligned in its tensor. */
void veoptim_adamw(const veoptim_adamw_tensor *tensors, int64_t count, int64_t min_parallel) {
  int64_t total = 0;
  for (int64_t i = 0; i < count; i++) total += (tensors[i].numel + 63) / 64 * 64;
  const int threads = total >= min_parallel ? omp_get_max_threads() : 1;
#pragma omp parallel num_threads(threads) if (threads > 1)
  {
    const int64_t parts = omp_get_num_threads(), me = omp_get_thread_num();
    const int64_t share = ((total + parts - 1) / parts + 63) / 64 * 64;
    const int64_t lo = me * share, hi = lo + share;
    int64_t base = 0;
    for (int64_t i = 0; i < count && base < hi; i++) {
      const veoptim_adamw_tensor *t = &tensors[i];
      const int64_t begin = lo > base ? lo - base : 0;
      const int64_t end = hi - base < t->numel ? hi - base : t->numel;
      if (begin < end)
        update_range(t->numel, begin, end, t->master, t->grad, t->grad_bf16, t->exp_avg,
                     t->exp_avg_sq, t->moments_bf16, t->out, t->out_kind, t->hyper);
      base += (t->numel + 63) / 64 * 64;
    }
  }
}

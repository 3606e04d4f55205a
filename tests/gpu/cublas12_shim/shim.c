/* Test-harness shim for GPU nodes whose image has cuBLAS 13 only (the device machine of this workplace):
 * provides the eight libcublas.so.12 entry points faiss-gpu-cu12 uses and forwards them to libcublas.so.13,
 * whose signatures for these calls are unchanged. Production GPU nodes install faiss-gpu-cu12 with its own
 * nvidia-cublas-cu12 and never need this. Build: see build.sh. */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <stdio.h>
#include <stdlib.h>

typedef int st;
static void *lib;

static void *sym(const char *name) {
  if (!lib) {
    lib = dlopen("libcublas.so.13", RTLD_NOW | RTLD_GLOBAL);
    if (!lib) { fprintf(stderr, "cublas12 shim: %s\n", dlerror()); abort(); }
  }
  void *f = dlsym(lib, name);
  if (!f) { fprintf(stderr, "cublas12 shim: no %s in libcublas.so.13\n", name); abort(); }
  return f;
}

st cublasCreate_v2(void **h) { return ((st(*)(void **))sym("cublasCreate_v2"))(h); }
st cublasDestroy_v2(void *h) { return ((st(*)(void *))sym("cublasDestroy_v2"))(h); }
st cublasSetStream_v2(void *h, void *s) { return ((st(*)(void *, void *))sym("cublasSetStream_v2"))(h, s); }
st cublasGetMathMode(void *h, int *m) { return ((st(*)(void *, int *))sym("cublasGetMathMode"))(h, m); }
st cublasSetMathMode(void *h, int m) { return ((st(*)(void *, int))sym("cublasSetMathMode"))(h, m); }

typedef st (*gemm_ex_t)(void *, int, int, int, int, int, const void *, const void *, int, int, const void *, int,
                        int, const void *, void *, int, int, int, int);
st cublasGemmEx(void *h, int ta, int tb, int m, int n, int k, const void *alpha, const void *A, int at, int lda,
                const void *B, int bt, int ldb, const void *beta, void *C, int ct, int ldc, int compute, int algo) {
  return ((gemm_ex_t)sym("cublasGemmEx"))(h, ta, tb, m, n, k, alpha, A, at, lda, B, bt, ldb, beta, C, ct, ldc,
                                           compute, algo);
}

typedef st (*gemm_sb_t)(void *, int, int, int, int, int, const void *, const void *, int, int, long long,
                        const void *, int, int, long long, const void *, void *, int, int, long long, int, int, int);
st cublasGemmStridedBatchedEx(void *h, int ta, int tb, int m, int n, int k, const void *alpha, const void *A, int at,
                              int lda, long long sa, const void *B, int bt, int ldb, long long sb, const void *beta,
                              void *C, int ct, int ldc, long long sc, int batch, int compute, int algo) {
  return ((gemm_sb_t)sym("cublasGemmStridedBatchedEx"))(h, ta, tb, m, n, k, alpha, A, at, lda, sa, B, bt, ldb, sb,
                                                         beta, C, ct, ldc, sc, batch, compute, algo);
}

typedef st (*sgemm_ex_t)(void *, int, int, int, int, int, const float *, const void *, int, int, const void *, int,
                         int, const float *, void *, int, int);
st cublasSgemmEx(void *h, int ta, int tb, int m, int n, int k, const float *alpha, const void *A, int at, int lda,
                 const void *B, int bt, int ldb, const float *beta, void *C, int ct, int ldc) {
  return ((sgemm_ex_t)sym("cublasSgemmEx"))(h, ta, tb, m, n, k, alpha, A, at, lda, B, bt, ldb, beta, C, ct, ldc);
}

/* MKL picks its kernels by CPU vendor: on a CPU that is not Intel's it takes a generic path whatever
 * MKL_ENABLE_INSTRUCTIONS asks (MKL_VERBOSE: "Intel(R) Architecture processors"). Preloaded, these two answer its
 * vendor check "Intel", so MKL_ENABLE_INSTRUCTIONS=AVX2 selects its AVX2 kernels there too (MKL_VERBOSE: "Intel(R)
 * AVX2"): .ci/run's second pass then runs the matrix products an Intel machine without AVX-512 runs, on any x86 CPU
 * with AVX2. The symbols are those of oneMKL 2024.0 as linked into PyTorch 2.13's CPU wheel (libtorch_cpu.so). */
int mkl_serv_intel_cpu_true(void) { return 1; }
int mkl_serv_intel_cpu(void) { return 1; }

/* Load a prebuilt GPU library and print, as JSON, what the Python loader reads from it: the C ABI's struct
 * layout (qmuon_cuda_abi_layout), the build record and the driver / device probe. Used by .ci/run to run an
 * aarch64 library's host code under qemu-aarch64 on an x86_64 machine (no aarch64 Python there):
 *
 *   aarch64-linux-gnu-gcc -O1 -o probe .ci/abi_probe.c -ldl && qemu-aarch64 -L /usr/aarch64-linux-gnu ./probe LIB
 */
#include <dlfcn.h>
#include <stdint.h>
#include <stdio.h>

int main(int argc, char** argv) {
  if (argc != 2) {
    fprintf(stderr, "usage: %s LIBRARY\n", argv[0]);
    return 2;
  }
  void* lib = dlopen(argv[1], RTLD_NOW | RTLD_LOCAL);
  if (!lib) {
    fprintf(stderr, "dlopen: %s\n", dlerror());
    return 1;
  }
  int64_t (*layout)(int64_t*, int64_t) = (int64_t (*)(int64_t*, int64_t))dlsym(lib, "qmuon_cuda_abi_layout");
  const char* (*info)(void) = (const char* (*)(void))dlsym(lib, "qmuon_cuda_build_info");
  int (*probe)(int*, int*) = (int (*)(int*, int*))dlsym(lib, "qmuon_cuda_probe");
  if (!layout || !info || !probe) {
    fprintf(stderr, "missing export: %s\n", dlerror());
    return 1;
  }
  int64_t buf[256];
  int64_t n = layout(NULL, 0);
  if (n <= 0 || n > 256 || layout(buf, n) != n) {
    fprintf(stderr, "qmuon_cuda_abi_layout returned %lld entries\n", (long long)n);
    return 1;
  }
  int driver = 0, devices = 0;
  int err = probe(&driver, &devices);
  printf("{\"layout\": [");
  for (int64_t i = 0; i < n; ++i) printf("%s%lld", i ? ", " : "", (long long)buf[i]);
  printf("], \"build_info\": %s, \"probe\": %d, \"driver\": %d, \"devices\": %d}\n", info(), err, driver, devices);
  return 0;
}

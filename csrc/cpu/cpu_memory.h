// Huge-page backing for large output buffers on the CPU.
//
// XLA's CPU runtime hands every call fresh output buffers; a large one is a new anonymous mapping
// whose pages the kernel faults in one 4 KiB page at a time on first write. On the machines we
// measured, that first touch costs more than the kernel's own memory traffic (writing 128 MiB of
// fresh memory: 53 ms with 4 KiB faults, 8.5 ms on 2 MiB pages; docs/performance.md), so a
// memory-bound kernel writing large outputs spends most of its time in the page-fault handler.
// Marking the buffer MADV_HUGEPAGE before writing lets the kernel back it with 2 MiB pages where
// transparent huge pages are enabled for madvised memory (the common "madvise" setting; PyTorch's
// CPU allocator offers the same). It is a hint: results never depend on it, and a refused hint
// changes nothing. Only buffers of at least kAdviseMinBytes are advised: glibc serves those with
// their own mappings, so the advice dies with the buffer and never fragments the heap.
// ATTNAUX_CPU_HUGE_PAGES=0 in the environment turns it off.
#ifndef ATTNAUX_CSRC_CPU_CPU_MEMORY_H_
#define ATTNAUX_CSRC_CPU_CPU_MEMORY_H_

#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <cstring>

#if defined(__linux__)
#include <sys/mman.h>
#endif

namespace attnaux::cpu {

inline constexpr size_t kHugePageBytes = size_t{2} << 20;
inline constexpr size_t kAdviseMinBytes = size_t{32} << 20;

inline bool HugePageAdviceEnabled() {
  static const bool enabled = [] {
    const char* env = std::getenv("ATTNAUX_CPU_HUGE_PAGES");
    return env == nullptr || std::strcmp(env, "0") != 0;
  }();
  return enabled;
}

// Advises huge pages for the whole 2 MiB pages inside [data, data + bytes).
inline void AdviseHugePages(void* data, size_t bytes) {
#if defined(__linux__) && defined(MADV_HUGEPAGE)
  if (data == nullptr || bytes < kAdviseMinBytes || !HugePageAdviceEnabled()) return;
  const uintptr_t first = reinterpret_cast<uintptr_t>(data);
  const uintptr_t begin = (first + kHugePageBytes - 1) & ~(kHugePageBytes - 1);
  const uintptr_t end = (first + bytes) & ~(kHugePageBytes - 1);
  if (end > begin) madvise(reinterpret_cast<void*>(begin), end - begin, MADV_HUGEPAGE);
#else
  (void)data;
  (void)bytes;
#endif
}

}  // namespace attnaux::cpu

#endif  // ATTNAUX_CSRC_CPU_CPU_MEMORY_H_

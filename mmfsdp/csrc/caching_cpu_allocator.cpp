// A caching CPU allocator for torch (mmfsdp/cpu_cache.py builds and installs it).
//
// Blocks of at least `min_bytes` are mapped on their own. When torch frees one,
// it stays mapped in a cache, and the next request of the same (page-rounded)
// size takes it back, most recently freed first: no system call, no fresh page.
// The cache is bounded by the high-water mark of the live bytes: memory is
// mapped only while live + cached stays at or below the most live at once in
// this window or the one before. Past that, the least recently freed blocks
// go first, the last of them resized in place (mremap) to the request, so its
// pages are kept. The resident set of these blocks therefore peaks where it
// would if each block were unmapped when freed, while a training loop that
// repeats its sizes step after step is served from the cache. A window ends
// at mark() (the runner marks every training iteration): what a one-off
// spike left cached (building the model, loading or saving a checkpoint) is
// unmapped one window later.
#include <c10/core/Allocator.h>
#include <c10/core/CPUAllocator.h>
#include <c10/core/Device.h>

#include <pthread.h>
#include <sys/mman.h>

#include <cstddef>
#include <cstdint>
#include <deque>
#include <list>
#include <mutex>
#include <unordered_map>

namespace {

constexpr size_t kPage = 4096;
constexpr size_t kHugePage = size_t{2} << 20;
const c10::Device kCPU(c10::DeviceType::CPU);

size_t round_to_page(size_t n) { return (n + kPage - 1) / kPage * kPage; }

struct Stats {
  uint64_t live_bytes = 0;       // handed out, not yet freed
  uint64_t cached_bytes = 0;     // freed, still mapped
  uint64_t high_water = 0;       // the most live bytes at once, ever
  uint64_t bound = 0;            // live + cached stays within this: the windows' high-water
  uint64_t hits = 0;             // requests served by a cached block of their size
  uint64_t resized = 0;          // requests served by resizing a cached block
  uint64_t mapped = 0;           // requests that mapped new memory
  uint64_t unmapped = 0;         // cached blocks unmapped to stay within the bound
  uint64_t fresh_bytes = 0;      // bytes newly mapped (by mmap or by growing a block)
};

class CachingCPUAllocator final : public c10::Allocator {
 public:
  CachingCPUAllocator(c10::Allocator* fallback, size_t min_bytes, bool huge_pages)
      : fallback_(fallback), min_bytes_(min_bytes), huge_pages_(huge_pages) {}

  c10::DataPtr allocate(size_t n) override {
    // Empty tensors and sizes that would wrap when rounded up are never mapped.
    if (n == 0 || n < min_bytes_ || n > SIZE_MAX - kPage) return fallback_->allocate(n);
    const size_t size = round_to_page(n);
    void* p = take(size);
    if (p == nullptr) return fallback_->allocate(n);  // the kernel refused a mapping
    if (c10::memoryProfilingEnabled()) report(p, static_cast<int64_t>(size), stats());
    return {p, p, &CachingCPUAllocator::deleter, kCPU};
  }

  // raw_deallocate passes every pointer raw_allocate returned, small ones included.
  c10::DeleterFnPtr raw_deleter() const override { return &CachingCPUAllocator::deleter; }

  void copy_data(void* dest, const void* src, std::size_t count) const override {
    default_copy_data(dest, src, count);
  }

  Stats stats() {
    std::lock_guard<std::mutex> lock(mu_);
    return stats_;
  }

  // Unmaps every cached block and starts a window; the bytes returned to the system.
  size_t release() {
    std::lock_guard<std::mutex> lock(mu_);
    const size_t bytes = stats_.cached_bytes;
    while (!lru_.empty()) unmap(pop_oldest());
    previous_window_high_ = window_high_ = stats_.live_bytes;
    update_bound();
    return bytes;
  }

  // Ends a window: the bound becomes the most live in it, and the least recently
  // freed blocks beyond that are unmapped; the bytes returned to the system.
  size_t mark() {
    std::lock_guard<std::mutex> lock(mu_);
    previous_window_high_ = window_high_;
    window_high_ = stats_.live_bytes;
    update_bound();
    size_t freed = 0;
    while (!lru_.empty() && stats_.live_bytes + stats_.cached_bytes > stats_.bound) {
      const Block oldest = pop_oldest();
      unmap(oldest);
      freed += oldest.size;
    }
    return freed;
  }

  static CachingCPUAllocator* instance;
  // fork() while another thread holds the lock would leave the child's copy locked.
  static void before_fork() { instance->mu_.lock(); }
  static void after_fork() { instance->mu_.unlock(); }

 private:
  struct Block {
    void* p;
    size_t size;
  };
  using Lru = std::list<Block>;  // front: most recently freed

  static void deleter(void* p) { instance->give_back(p); }

  void* take(size_t size) {
    std::lock_guard<std::mutex> lock(mu_);
    void* p = nullptr;
    auto same = by_size_.find(size);
    if (same != by_size_.end()) {
      p = same->second.back()->p;
      erase(same, /*newest=*/true);
      ++stats_.hits;
    } else {
      p = make_room_and_map(size);
      if (p == nullptr) return nullptr;
    }
    sizes_.emplace(p, size);
    stats_.live_bytes += size;
    if (stats_.live_bytes > stats_.high_water) stats_.high_water = stats_.live_bytes;
    if (stats_.live_bytes > window_high_) {
      window_high_ = stats_.live_bytes;
      update_bound();
    }
    return p;
  }

  // Maps `size` bytes within the bound, evicting the least recently freed blocks
  // first; the block whose eviction would make room is resized instead.
  void* make_room_and_map(size_t size) {
    // The live high-water may rise by this request; the bound rises with it.
    const uint64_t bound = std::max(stats_.bound, stats_.live_bytes + size);
    while (!lru_.empty() && stats_.live_bytes + stats_.cached_bytes + size > bound) {
      Block oldest = pop_oldest();
      if (stats_.live_bytes + stats_.cached_bytes + size <= bound) {  // resizing it fits
        void* q = mremap(oldest.p, oldest.size, size, MREMAP_MAYMOVE);
        if (q == MAP_FAILED) {
          unmap(oldest);
          break;
        }
        if (size > oldest.size) {
          stats_.fresh_bytes += size - oldest.size;
          advise(q, size);
        }
        ++stats_.resized;
        return q;
      }
      unmap(oldest);
    }
    void* p = mmap(nullptr, size, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (p == MAP_FAILED) {  // out of memory or of mappings: give the cache back and retry
      while (!lru_.empty()) unmap(pop_oldest());
      p = mmap(nullptr, size, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
      if (p == MAP_FAILED) return nullptr;
    }
    advise(p, size);
    ++stats_.mapped;
    stats_.fresh_bytes += size;
    return p;
  }

  void give_back(void* p) {
    std::unique_lock<std::mutex> lock(mu_);
    auto it = sizes_.find(p);
    if (it == sizes_.end()) {  // a small block, or one the fallback served
      lock.unlock();
      fallback_->raw_deleter()(p);
      return;
    }
    const size_t size = it->second;
    sizes_.erase(it);
    stats_.live_bytes -= size;
    stats_.cached_bytes += size;
    if (c10::memoryProfilingEnabled()) {
      // The profiler pairs events by address: report the free before the block is in the
      // cache, where another thread could take it and report its allocation first.
      const Stats s = stats_;
      lock.unlock();
      report(p, -static_cast<int64_t>(size), s);
      lock.lock();
    }
    lru_.push_front(Block{p, size});
    by_size_[size].push_back(lru_.begin());
  }

  // What c10's own CPU allocator tells torch.profiler (profile_memory=True); called without
  // the lock held, with the counters as they were after the change.
  static void report(void* p, int64_t delta, const Stats& s) {
    c10::reportMemoryUsageToProfiler(p, delta, s.live_bytes, s.live_bytes + s.cached_bytes, kCPU);
  }

  Block pop_oldest() {
    Block oldest = lru_.back();
    // The oldest block of all is the oldest of its size: the front of its queue.
    erase(by_size_.find(oldest.size), /*newest=*/false);
    return oldest;
  }

  void erase(std::unordered_map<size_t, std::deque<Lru::iterator>>::iterator same, bool newest) {
    std::deque<Lru::iterator>& queue = same->second;
    Lru::iterator block = newest ? queue.back() : queue.front();
    stats_.cached_bytes -= block->size;
    lru_.erase(block);
    if (newest) {
      queue.pop_back();
    } else {
      queue.pop_front();
    }
    if (queue.empty()) by_size_.erase(same);
  }

  void update_bound() { stats_.bound = std::max(previous_window_high_, window_high_); }

  void unmap(const Block& block) {
    munmap(block.p, block.size);
    ++stats_.unmapped;
  }

  void advise(void* p, size_t size) {
    if (huge_pages_ && size >= kHugePage) madvise(p, size, MADV_HUGEPAGE);
  }

  c10::Allocator* fallback_;
  const size_t min_bytes_;
  const bool huge_pages_;
  std::mutex mu_;
  Lru lru_;
  std::unordered_map<size_t, std::deque<Lru::iterator>> by_size_;  // oldest first
  std::unordered_map<void*, size_t> sizes_;                         // live blocks
  uint64_t window_high_ = 0;           // the most live bytes at once since mark()
  uint64_t previous_window_high_ = 0;  // ... in the window before
  Stats stats_;
};

CachingCPUAllocator* CachingCPUAllocator::instance = nullptr;

}  // namespace

extern "C" {

// Serves every later CPU allocation of at least `min_bytes` bytes; 0 on success,
// 1 if this process has one installed already.
int mmfsdp_cpu_cache_install(size_t min_bytes, int huge_pages) {
  static std::mutex installing;
  std::lock_guard<std::mutex> lock(installing);
  if (CachingCPUAllocator::instance != nullptr) return 1;
  // Never deleted: tensors it allocated may outlive every Python object.
  CachingCPUAllocator::instance =
      new CachingCPUAllocator(c10::GetCPUAllocator(), min_bytes, huge_pages != 0);
  pthread_atfork(&CachingCPUAllocator::before_fork, &CachingCPUAllocator::after_fork,
                 &CachingCPUAllocator::after_fork);
  c10::SetCPUAllocator(CachingCPUAllocator::instance, /*priority=*/UINT8_MAX);
  return 0;
}

// Fills `out` with the Stats fields in their order; 1 if none is installed.
int mmfsdp_cpu_cache_stats(uint64_t* out) {
  if (CachingCPUAllocator::instance == nullptr) return 1;
  const Stats s = CachingCPUAllocator::instance->stats();
  const uint64_t values[] = {s.live_bytes, s.cached_bytes, s.high_water, s.bound,    s.hits,
                             s.resized,    s.mapped,       s.unmapped,   s.fresh_bytes};
  for (size_t i = 0; i < sizeof(values) / sizeof(values[0]); ++i) out[i] = values[i];
  return 0;
}

size_t mmfsdp_cpu_cache_mark() {
  return CachingCPUAllocator::instance == nullptr ? 0 : CachingCPUAllocator::instance->mark();
}

size_t mmfsdp_cpu_cache_release() {
  return CachingCPUAllocator::instance == nullptr ? 0
                                                  : CachingCPUAllocator::instance->release();
}

}  // extern "C"

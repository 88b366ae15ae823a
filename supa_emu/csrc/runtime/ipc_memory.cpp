// Device memory shared between processes, the emulator's CUDA IPC: a supa storage that is
// sent to another process moves into a shared-memory block (a memfd mapping) that the
// receiver maps too, so both processes read and write the same bytes.
//
// Block layout: one header page (magic, size, count of pending references), then the data.
// As in CUDA IPC, each export (one pickled message) adds a pending reference; a receiver
// keeps it while its mapping lives, or drops it at once when it already maps the block.
//
// Accounting: the storage keeps its original device block as a ticket, so the sender's
// statistics do not change when it shares (the data lives in the mapping from then on).
// When the sender's storage dies while receivers still hold references, the ticket waits in
// a limbo list, still counted, until they are gone (CUDA's IPC limbo);
// collect_shared_blocks() (torch.supa.ipc_collect) and every new export release it.
// Receivers count nothing for the memory they map, as memory opened by cudaIpcOpenMemHandle
// is outside the receiver's caching allocator.
#include "ipc_memory.h"

#include "caching_allocator.h"
#include "devices.h"

#include <c10/util/Exception.h>

#include <atomic>
#include <cerrno>
#include <cstring>
#include <list>
#include <mutex>

#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

namespace supa {
namespace {

constexpr uint64_t kMagic = 0x4b4c425f41505553ULL;  // "SUPA_BLK"

struct Header {
  uint64_t magic;
  uint64_t nbytes;
  std::atomic<int64_t> pending;  // references held by messages in flight and by receivers
};
static_assert(std::atomic<int64_t>::is_always_lock_free, "the reference count lives in shared memory");

size_t header_size() {
  static const size_t page = static_cast<size_t>(sysconf(_SC_PAGESIZE));
  return page;
}

// One mapping of a shared block in this process; the context of the storage's DataPtr.
struct Mapping {
  void* base = nullptr;
  size_t length = 0;
  int fd = -1;          // kept open so that the storage can be sent on again
  c10::DataPtr ticket;  // exporter only: the device block the statistics count
  bool imported = false;

  Header* header() const {
    return static_cast<Header*>(base);
  }
  void* data() const {
    return static_cast<char*>(base) + header_size();
  }
  ~Mapping() {
    if (base != nullptr) {
      munmap(base, length);
    }
    if (fd >= 0) {
      close(fd);
    }
  }
};

// Guards the limbo list and the first export of a storage (two threads may pickle it at once,
// e.g. a queue's feeder thread and a pipe in the main thread).
std::mutex g_ipc_mutex;
std::list<Mapping*> g_limbo;  // exported blocks whose sender storage died before its receivers

size_t collect_limbo_locked() {
  size_t released = 0;
  for (auto it = g_limbo.begin(); it != g_limbo.end();) {
    if ((*it)->header()->pending.load() <= 0) {
      delete *it;
      it = g_limbo.erase(it);
      ++released;
    } else {
      ++it;
    }
  }
  return released;
}

void release_exported(void* ctx) {
  auto* mapping = static_cast<Mapping*>(ctx);
  if (mapping->header()->pending.load() <= 0) {
    delete mapping;
    return;
  }
  std::lock_guard<std::mutex> lock(g_ipc_mutex);
  g_limbo.push_back(mapping);
}

void release_imported(void* ctx) {
  auto* mapping = static_cast<Mapping*>(ctx);
  mapping->header()->pending.fetch_sub(1);
  delete mapping;
}

Mapping* mapping_of(const c10::Storage& storage) {
  const c10::DataPtr& ptr = storage.data_ptr();
  const auto deleter = ptr.get_deleter();
  if (deleter != &release_exported && deleter != &release_imported) {
    return nullptr;
  }
  return static_cast<Mapping*>(ptr.get_context());
}

void* map_block(int fd, size_t length) {
  void* base = mmap(nullptr, length, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  TORCH_CHECK(base != MAP_FAILED, "supa_emu: cannot map shared device memory (", length, " bytes): ",
              std::strerror(errno));
  return base;
}

Mapping* move_to_shared_block(c10::StorageImpl* storage) {
  const size_t nbytes = storage->nbytes();
  auto mapping = std::make_unique<Mapping>();
  mapping->fd = memfd_create("supa_emu_device_block", MFD_CLOEXEC);
  TORCH_CHECK(mapping->fd >= 0, "supa_emu: cannot create shared device memory: ", std::strerror(errno));
  // A memfd starts out 0777: any process of another user that reaches the descriptor (through
  // /proc/<pid>/fd) could map the tensor's bytes. Only the owner may read and write them.
  TORCH_CHECK(fchmod(mapping->fd, S_IRUSR | S_IWUSR) == 0, "supa_emu: cannot restrict shared device memory: ",
              std::strerror(errno));
  mapping->length = header_size() + nbytes;
  TORCH_CHECK(ftruncate(mapping->fd, static_cast<off_t>(mapping->length)) == 0,
              "supa_emu: cannot size shared device memory (", nbytes, " bytes): ", std::strerror(errno));
  mapping->base = map_block(mapping->fd, mapping->length);
  Header* header = new (mapping->base) Header{kMagic, nbytes, {0}};
  (void)header;
  std::memcpy(mapping->data(), storage->data(), nbytes);
  Mapping* raw = mapping.release();
  c10::DataPtr shared(raw->data(), raw, &release_exported, storage->device());
  // The old block stays intact (not only counted): an operator running in another thread may
  // still read it through a pointer taken before the swap (a queue pickles in its feeder thread).
  raw->ticket = storage->set_data_ptr(std::move(shared));
  return raw;
}

}  // namespace

SharedBlock export_storage(const c10::Storage& storage) {
  TORCH_CHECK(storage.device().type() == kSupa, "export_storage expects a supa storage, got ", storage.device());
  std::lock_guard<std::mutex> lock(g_ipc_mutex);
  collect_limbo_locked();
  if (storage.nbytes() == 0) {
    return {-1, 0};
  }
  Mapping* mapping = mapping_of(storage);
  if (mapping == nullptr) {
    mapping = move_to_shared_block(storage.unsafeGetStorageImpl());
  }
  mapping->header()->pending.fetch_add(1);
  return {mapping->fd, mapping->header()->nbytes};
}

c10::Storage import_storage(int fd, size_t nbytes, c10::DeviceIndex device) {
  check_device_index(device);
  struct stat st {};
  TORCH_CHECK(fstat(fd, &st) == 0, "supa_emu: invalid shared device memory handle: ", std::strerror(errno));
  const size_t length = header_size() + nbytes;
  TORCH_CHECK(static_cast<size_t>(st.st_size) == length, "supa_emu: shared device memory handle has ",
              st.st_size, " bytes, expected ", length);
  auto mapping = std::make_unique<Mapping>();
  mapping->base = map_block(fd, length);
  mapping->length = length;
  TORCH_CHECK(mapping->header()->magic == kMagic && mapping->header()->nbytes == nbytes,
              "supa_emu: the handle does not name a shared supa device block");
  mapping->fd = dup(fd);
  TORCH_CHECK(mapping->fd >= 0, "supa_emu: cannot keep the shared device memory handle: ", std::strerror(errno));
  mapping->imported = true;
  Mapping* raw = mapping.release();
  c10::DataPtr ptr(raw->data(), raw, &release_imported, c10::Device(kSupa, device));
  // Not resizable: a resize would silently stop sharing (as for CUDA IPC storages).
  return c10::Storage(c10::make_intrusive<c10::StorageImpl>(c10::StorageImpl::use_byte_size_t(), nbytes,
                                                            std::move(ptr), device_allocator(),
                                                            /*resizable=*/false));
}

void release_pending_reference(const c10::Storage& storage) {
  Mapping* mapping = mapping_of(storage);
  TORCH_CHECK(mapping != nullptr, "release_pending_reference: the storage is not shared with other processes");
  mapping->header()->pending.fetch_sub(1);
}

bool is_shared_storage(const c10::Storage& storage) {
  return mapping_of(storage) != nullptr;
}

size_t collect_shared_blocks() {
  std::lock_guard<std::mutex> lock(g_ipc_mutex);
  return collect_limbo_locked();
}

}  // namespace supa

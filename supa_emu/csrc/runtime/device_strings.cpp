// "cuda" device strings mean "supa": the native half of transfer_to_supa.
//
// Every device string that comes from Python ("cuda:1" in torch.device, a factory's device=,
// Tensor.to, Module.to, torch.Generator, map_location ...) is parsed by the out-of-line
// constructor c10::Device(const std::string&), defined in libc10.so and called by
// libtorch_python.so through an entry of its global offset table. The real torch_supa
// rewrites that entry so the constructor first turns a leading "cuda" into "supa"; we do the
// same, for the same reasons: it is the one place all Python-visible strings pass, it needs no
// change to PyTorch, and C++ callers inside libtorch_cpu (TorchScript, C++ serialisation) keep
// CUDA's meaning, as on the real stack. The result is an ordinary supa device: its `.type` is
// "supa" and it prints as supa.
#include "device_strings.h"

#include <c10/core/Device.h>
#include <c10/util/Exception.h>

#include <dlfcn.h>
#include <elf.h>
#include <link.h>
#include <sys/mman.h>
#include <unistd.h>

#include <atomic>
#include <cstring>
#include <mutex>
#include <string>

namespace supa {
namespace {

// c10::Device::Device(const std::string&), complete-object constructor (Itanium C++ ABI).
constexpr const char* kDeviceFromString = "_ZN3c106DeviceC1ERKNSt7__cxx1112basic_stringIcSt11char_traitsIcESaIcEEE";
constexpr const char* kPythonBindings = "libtorch_python.so";

using DeviceFromString = void (*)(c10::Device*, const std::string&);
DeviceFromString g_parse = nullptr;  // the constructor in libc10.so
std::atomic<bool> g_cuda_means_supa{false};

void parse_device_string(c10::Device* self, const std::string& text) {
  if (g_cuda_means_supa.load(std::memory_order_relaxed) && text.compare(0, 4, "cuda") == 0) {
    g_parse(self, "supa" + text.substr(4));
  } else {
    g_parse(self, text);
  }
}

struct Library {
  ElfW(Addr) base = 0;
  const ElfW(Phdr)* phdrs = nullptr;
  ElfW(Half) phnum = 0;
};

int find_bindings(struct dl_phdr_info* info, size_t, void* out) {
  if (info->dlpi_name != nullptr && std::strstr(info->dlpi_name, kPythonBindings) != nullptr) {
    auto* library = static_cast<Library*>(out);
    library->base = info->dlpi_addr;
    library->phdrs = info->dlpi_phdr;
    library->phnum = info->dlpi_phnum;
    return 1;
  }
  return 0;
}

// The dynamic loader has already relocated most pointers of the dynamic section; on the few
// platforms where it does not, they are still offsets from the load address.
template <typename T>
T* dynamic_pointer(ElfW(Addr) value, ElfW(Addr) base) {
  return reinterpret_cast<T*>(value < base ? value + base : value);
}

// Points the GOT slot(s) of `symbol` in `library` at `replacement`; returns how many it changed.
int rewrite_got(const Library& library, const char* symbol, void* replacement) {
  const ElfW(Dyn)* dynamic = nullptr;
  ElfW(Addr) relro_begin = 0, relro_end = 0;
  for (ElfW(Half) i = 0; i < library.phnum; ++i) {
    const ElfW(Phdr)& ph = library.phdrs[i];
    if (ph.p_type == PT_DYNAMIC) {
      dynamic = reinterpret_cast<const ElfW(Dyn)*>(library.base + ph.p_vaddr);
    } else if (ph.p_type == PT_GNU_RELRO) {
      relro_begin = library.base + ph.p_vaddr;
      relro_end = relro_begin + ph.p_memsz;
    }
  }
  TORCH_CHECK(dynamic != nullptr, "supa_emu: ", kPythonBindings, " has no dynamic section");
  const ElfW(Sym)* symbols = nullptr;
  const char* names = nullptr;
  const ElfW(Rela)* tables[2] = {nullptr, nullptr};
  size_t sizes[2] = {0, 0};
  for (const ElfW(Dyn)* d = dynamic; d->d_tag != DT_NULL; ++d) {
    switch (d->d_tag) {
      case DT_SYMTAB: symbols = dynamic_pointer<const ElfW(Sym)>(d->d_un.d_ptr, library.base); break;
      case DT_STRTAB: names = dynamic_pointer<const char>(d->d_un.d_ptr, library.base); break;
      case DT_JMPREL: tables[0] = dynamic_pointer<const ElfW(Rela)>(d->d_un.d_ptr, library.base); break;
      case DT_PLTRELSZ: sizes[0] = d->d_un.d_val; break;
      case DT_RELA: tables[1] = dynamic_pointer<const ElfW(Rela)>(d->d_un.d_ptr, library.base); break;
      case DT_RELASZ: sizes[1] = d->d_un.d_val; break;
      default: break;
    }
  }
  TORCH_CHECK(symbols != nullptr && names != nullptr, "supa_emu: ", kPythonBindings, " has no symbol table");
  const long page = sysconf(_SC_PAGESIZE);
  int rewritten = 0;
  for (int t = 0; t < 2; ++t) {
    for (size_t k = 0; tables[t] != nullptr && k < sizes[t] / sizeof(ElfW(Rela)); ++k) {
      const ElfW(Rela)& rel = tables[t][k];
      const size_t index = ELF64_R_SYM(rel.r_info);
      if (index == 0 || std::strcmp(names + symbols[index].st_name, symbol) != 0) {
        continue;
      }
      auto slot = library.base + rel.r_offset;
      void* page_start = reinterpret_cast<void*>(slot & ~static_cast<ElfW(Addr)>(page - 1));
      TORCH_CHECK(mprotect(page_start, page, PROT_READ | PROT_WRITE) == 0,
                  "supa_emu: cannot make the GOT of ", kPythonBindings, " writable");
      *reinterpret_cast<void**>(slot) = replacement;
      if (slot >= relro_begin && slot < relro_end) {
        mprotect(page_start, page, PROT_READ);  // back to what RELRO made it
      }
      ++rewritten;
    }
  }
  return rewritten;
}

void install_parser() {
  static std::once_flag once;
  std::call_once(once, [] {
    void* c10 = dlopen("libc10.so", RTLD_LAZY | RTLD_NOLOAD);
    TORCH_CHECK(c10 != nullptr, "supa_emu: libc10.so is not loaded");
    g_parse = reinterpret_cast<DeviceFromString>(dlsym(c10, kDeviceFromString));
    dlclose(c10);
    TORCH_CHECK(g_parse != nullptr, "supa_emu: libc10.so does not export c10::Device(const std::string&)");
    Library library;
    dl_iterate_phdr(&find_bindings, &library);
    TORCH_CHECK(library.phdrs != nullptr, "supa_emu: ", kPythonBindings, " is not loaded");
    TORCH_CHECK(rewrite_got(library, kDeviceFromString, reinterpret_cast<void*>(&parse_device_string)) > 0,
                "supa_emu: ", kPythonBindings, " does not import c10::Device(const std::string&); cannot ",
                "redirect \"cuda\" device strings on this torch build");
  });
}

}  // namespace

void set_cuda_means_supa(bool enabled) {
  if (enabled) {
    install_parser();
  }
  g_cuda_means_supa.store(enabled);
}

bool cuda_means_supa() {
  return g_cuda_means_supa.load();
}

}  // namespace supa

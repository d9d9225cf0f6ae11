# llep_add_test(NAME <name> SOURCES <files...> LIBS <targets...> [LABELS <labels...>] [TIMEOUT <s>] [SERIAL])
# A gtest binary next to the code it tests; each TEST becomes a ctest entry (gtest_discover_tests).
include(GoogleTest)
function(llep_add_test)
  cmake_parse_arguments(T "SERIAL" "NAME;TIMEOUT" "SOURCES;LIBS;LABELS" ${ARGN})
  if(NOT LLEP_BUILD_TESTS)
    return()
  endif()
  if(NOT T_LABELS)
    set(T_LABELS unit)
  endif()
  if(NOT T_TIMEOUT)
    set(T_TIMEOUT 120)
  endif()
  add_executable(${T_NAME} ${T_SOURCES})
  target_link_libraries(${T_NAME} PRIVATE ${T_LIBS} GTest::gtest_main GTest::gmock)
  set(props LABELS "${T_LABELS}" TIMEOUT ${T_TIMEOUT})
  if(T_SERIAL)
    list(APPEND props RUN_SERIAL TRUE)
  endif()
  gtest_discover_tests(${T_NAME} DISCOVERY_TIMEOUT 60 PROPERTIES ${props})
endfunction()

# llep_gpu_sources(<target> <files...>): adds GPU source files (.cu) to <target> for the configured back end. CUDA
# compiles them as CUDA (LLEP_GPU=cuda); HIP compiles the same files as HIP with clang (LLEP_GPU=hip: every source of
# the target is then HIP, so GPU targets hold GPU code and the host code that launches it).
function(llep_gpu_sources target)
  target_sources(${target} PRIVATE ${ARGN})
  if(LLEP_HAVE_HIP)
    set_source_files_properties(${ARGN} TARGET_DIRECTORY ${target} PROPERTIES LANGUAGE CXX)
    target_link_libraries(${target} PRIVATE hip::device)
    target_compile_options(${target} PRIVATE --rocm-path=${LLEP_ROCM_PATH}
                                             --rocm-device-lib-path=${LLEP_ROCM_DEVICE_LIBS})
  else()
    target_compile_options(${target} PRIVATE $<$<COMPILE_LANGUAGE:CUDA>:--expt-relaxed-constexpr>)
  endif()
endfunction()

# The GPU runtime library of the configured back end, for host code that calls it (runtime/gpu_api.h).
if(LLEP_HAVE_HIP)
  set(LLEP_GPU_RUNTIME hip::host)
elseif(LLEP_HAVE_CUDA)
  set(LLEP_GPU_RUNTIME CUDA::cudart_static)
endif()

# llama.cpp's test-profile build (scripts/install_llamacpp.sh: -DCMAKE_UNITY_BUILD=ON and
# -DCMAKE_PROJECT_INCLUDE=<this file>, which cmake includes right after every project() call): a unity build, except
# where sources cannot share a translation unit. ggml's CPU sources define the same static helpers in several files
# (ggml-cpu/repack.cpp and ggml-cpu/arch/x86/repack.cpp: nearest_int): ggml builds file by file, as released.
# tools/mtmd's helper sources refuse to be compiled beside mtmd's internal headers (mtmd-helper.cpp: #error): they
# build on their own, the rest of the mtmd library (clip and its ~45 model files) as one unit per 16 files (measured
# on an AVX-512 EPYC, ninja -j2: mtmd 17 CPU-s instead of 64, the whole build 270 CPU-s instead of 313).
if(PROJECT_NAME STREQUAL "ggml")
    set(CMAKE_UNITY_BUILD OFF)
elseif(CMAKE_CURRENT_SOURCE_DIR STREQUAL CMAKE_SOURCE_DIR)
    function(eagle_lib_mtmd_units)
        get_property(targets DIRECTORY "${CMAKE_SOURCE_DIR}/tools/mtmd" PROPERTY BUILDSYSTEM_TARGETS)
        foreach(t IN LISTS targets)
            if(t STREQUAL "mtmd")
                set_property(SOURCE "${CMAKE_SOURCE_DIR}/tools/mtmd/mtmd-helper.cpp"
                             "${CMAKE_SOURCE_DIR}/tools/mtmd/mtmd-helper-gen.cpp"
                             DIRECTORY "${CMAKE_SOURCE_DIR}/tools/mtmd" PROPERTY SKIP_UNITY_BUILD_INCLUSION ON)
            else()
                set_property(TARGET "${t}" PROPERTY UNITY_BUILD OFF)
            endif()
        endforeach()
    endfunction()
    # at the end of the top-level CMakeLists, when tools/mtmd's targets exist
    cmake_language(DEFER DIRECTORY "${CMAKE_SOURCE_DIR}" CALL eagle_lib_mtmd_units)
endif()
